#!/usr/bin/env python3
"""Prove that every lesson grader catches the mistakes learners make, and says which.

Each entry below is a plausible wrong answer: the reference solution with one mistake put in (sum
instead of average, the padding forgotten, an all-reduce where a reduce-scatter is asked, ...).
For each, this script writes the mistaken solution over the lesson's exercise.rs, grades the
exercise strictly (`SHARDLAB_GRADE=strict cargo test --test lessonNN exercise::exK_`) and
requires that exercise K fails with a message containing `expect`. Mistakes of different
exercises of one lesson are graded together (one build per round). exercise.rs is restored
afterwards, whatever happens.

Run from the repository root: `python3 .ci/wrong_answers.py [NN ...]`.
"""
import os
import re
import subprocess
import sys
from collections import defaultdict

# (lesson, exercise, mistake, [(find, replace), ...], expect)
WRONG = [
    ("01", 1, "every rank dials every other rank",
     [("((0..rank).collect(), (rank + 1..world_size).collect())",
       "((0..world_size).filter(|&p| p != rank).collect(), vec![])")],
     "does not accept"),
    ("01", 2, "a missing rank is skipped instead of reported",
     [("None => missing.push(r),", "None => {}"),
      ("let mut missing = Vec::new();\n    for r in 0..world_size {\n        let left",
       "let missing: Vec<usize> = Vec::new();\n    for r in 0..world_size {\n        let left")],
     "must be an error"),
    ("01", 3, "the first arrival opens the barrier",
     [("== world_size as i64 {", ">= 1 {")],
     "before the last rank arrived"),
    ("02", 1, "a chain instead of a binomial tree",
     [("(Some(v - low), low)", "(Some(v - 1), low)")],
     "parent is not"),
    ("02", 2, "relative ranks used as real ranks",
     [("pg.recv(t, (p + root) % n)?;", "pg.recv(t, p)?;"), ("pg.send(t, (c + root) % n)?;", "pg.send(t, c)?;")],
     "cannot receive from self"),
    ("02", 3, "broadcast without the verification",
     [("if hi.int64_value(&[0]) != lo.int64_value(&[0]) {", "if false {")],
     "compare every rank's checksum"),
    ("03", 1, "the remainder is forgotten",
     [("numel * i / n..numel * (i + 1) / n", "numel / n * i..numel / n * (i + 1)")],
     "cover all"),
    ("03", 2, "the all-gather phase reuses the reduce-scatter schedule",
     [("if gather {\n        ((rank + 1 + n - step) % n, (rank + n - step) % n)", "if false {\n        (0, 0)")],
     "before it is complete"),
    ("03", 3, "the all-gather phase adds instead of copying",
     [("dst.copy_(&incoming);", "dst += &incoming;")],
     "wrong sum"),
    ("03", 3, "every rank sends before it receives (deadlocks over TCP)",
     [("if r % 2 == 0 {", "if r < n {")],
     "timed out"),
    ("03", 4, "the ring's bandwidth term without 2(n-1)/n",
     [("2.0 * (nf - 1.0) * alpha + 2.0 * (nf - 1.0) / nf * bytes * beta", "2.0 * (nf - 1.0) * alpha + bytes * beta")],
     "ring for n=4"),
    ("04", 1, "overlapping rows",
     [("rank * b..(rank + 1) * b", "rank..rank + b")],
     "rows overlap"),
    ("04", 2, "one broadcast per parameter (no buckets)",
     [("while end < params.len() && size + bytes(&params[end]) <= bucket_bytes {",
       "while end < params.len() && bucket_bytes == 0 {")],
     "broadcast(s) move these"),
    ("04", 2, "the bucket is broadcast but never copied back",
     [("p.copy_(&flat.narrow(0, offset, n).view_as(p));", "let _ = (&p, &flat);")],
     "rank 0's initial weights"),
    ("04", 3, "sum instead of average",
     [("let _ = g.divide_scalar_(n);", "let _ = n;")],
     "average"),
    ("04", 4, "gradients never averaged",
     [("    average_gradients(pg, &model.parameters())?;\n", "")],
     "one process"),
    ("05", 1, "buckets in forward order",
     [("for i in (0..sizes.len()).rev() {", "for i in 0..sizes.len() {")],
     "reverse"),
    ("05", 2, "the latest stage instead of the earliest",
     [(".min().expect(", ".max().expect(")],
     "last params"),
    ("05", 3, "a sync on every micro-batch",
     [("dp.set_require_sync(last);", "dp.set_require_sync(true);\n        let _ = last;")],
     "once per step"),
    ("06", 1, "the padding is forgotten",
     [("let shard = (numel + n - 1) / n;", "let shard = numel / n;")],
     "pad"),
    ("06", 2, "an all-reduce of zero-padded shards where an all-gather is asked",
     [("pg.all_gather(&mut full, shard)?;",
       "full.narrow(0, pg.rank() as i64 * shard.numel() as i64, shard.numel() as i64).copy_(shard);\n"
       "    pg.all_reduce(&mut full, ReduceOp::Sum)?;")],
     "exactly one all_gather"),
    ("06", 3, "an all-reduce where a reduce-scatter is asked",
     [("pg.reduce_scatter(&mut out, full_grad, ReduceOp::Avg)?;",
       "let mut all = full_grad.copy();\n    pg.all_reduce(&mut all, ReduceOp::Avg)?;\n"
       "    out.copy_(&all.narrow(0, pg.rank() as i64 * shard, shard));")],
     "exactly one reduce_scatter"),
    ("06", 3, "sum instead of average",
     [("pg.reduce_scatter(&mut out, full_grad, ReduceOp::Avg)?;", "pg.reduce_scatter(&mut out, full_grad, ReduceOp::Sum)?;")],
     "the average of every rank"),
    ("06", 4, "every unit gathered up front, none prefetched",
     [("    let mut next = if units > 0 { Some(start(0)?) } else { None };\n    for u in 0..units {\n"
       "        let (buf, work) = next.take().expect(\"started one unit ahead\");",
       "    let mut all = (0..units).map(&start).collect::<CommResult<Vec<_>>>()?;\n    all.reverse();\n"
       "    for u in 0..units {\n        let (buf, work) = all.pop().expect(\"gathered up front\");"),
      ("            next = Some(start(u + 1)?); // prefetch\n", "")],
     "at most 2 gathered units"),
    ("06", 4, "forward's units kept until the end of the step",
     [("        stack.forward(u, &buf);\n        drop(buf);", "        stack.forward(u, &buf);\n        kept.push(buf);"),
      ("    let units = stack.num_units();\n", "    let units = stack.num_units();\n    let mut kept = Vec::new();\n")],
     "at most 2 gathered units"),
    ("06", 4, "no prefetch: each unit gathered only when it is needed",
     [("        if u + 1 < units {\n            next = Some(start(u + 1)?); // prefetch\n        }\n        stack.forward(u, &buf);",
       "        stack.forward(u, &buf);\n        if u + 1 < units {\n            next = Some(start(u + 1)?);\n        }")],
     "prefetch one unit ahead"),
    ("06", 4, "an all-reduce of the gradient where a reduce-scatter is asked",
     [("        grads.push(reduce_scatter_grads(pg, &full_grad)?);",
       "        let mut all = full_grad.copy();\n        pg.all_reduce(&mut all, ReduceOp::Avg)?;\n"
       "        let len = full_grad.numel() as i64 / pg.world_size() as i64;\n"
       "        grads.push(all.narrow(0, pg.rank() as i64 * len, len).copy());")],
     "FSDP needs no all_reduce"),
    ("07", 1, "stage 2 shards the parameters too",
     [("2 => 2.0 * params + (2.0 + k) * params / dp,", "2 => (2.0 + 2.0 + k) * params / dp,")],
     "stage 2: got"),
    ("07", 2, "no bias correction",
     [("let (bc1, bc2) = (1.0 - b1.powi(t), 1.0 - b2.powi(t));", "let (bc1, bc2) = (1.0, 1.0 + 0.0 * t as f64);")],
     "libtorch"),
    ("07", 3, "all_reduce(Sum) where an all-gather is asked",
     [("pg.all_gather(flat, &shard.copy())", "let _ = shard;\n    pg.all_reduce(flat, ReduceOp::Sum)")],
     "exactly one all_gather"),
    ("07", 4, "an all-reduce and a slice where a reduce-scatter is asked",
     [("    pg.reduce_scatter(&mut g, grad, ReduceOp::Avg)?;",
       "    let mut all = grad.copy();\n    pg.all_reduce(&mut all, ReduceOp::Avg)?;\n"
       "    g.copy_(&all.narrow(0, pg.rank() as i64 * shard_len, shard_len));")],
     "ZeRO-1 needs no all_reduce"),
    ("07", 4, "the gradient summed, not averaged",
     [("    pg.reduce_scatter(&mut g, grad, ReduceOp::Avg)?;", "    pg.reduce_scatter(&mut g, grad, ReduceOp::Sum)?;")],
     "libtorch's AdamW on the gradient averaged"),
    ("07", 4, "the updated parameters never all-gathered",
     [("    all_gather_params(pg, flat, &shard)\n}", "    let _ = shard;\n    Ok(())\n}")],
     "exactly one reduce_scatter"),
    ("08", 1, "truncation instead of rounding",
     [("    let rounded = bits.wrapping_add(0x7FFF + lsb);\n", "    let rounded = bits;\n")],
     "truncation"),
    ("08", 1, "ties rounded up, not to even",
     [("bits.wrapping_add(0x7FFF + lsb)", "bits.wrapping_add(0x8000)")],
     "ties go to the neighbour"),
    ("08", 2, "the step taken on the bf16 working copy",
     [("        let _ = master.g_add_(&(g * -lr));\n        working.copy_(master);",
       "        let _ = working.g_add_(&(g * -lr));\n        master.copy_(working);")],
     "no update survived"),
    ("08", 3, "the count of clean steps not restarted on an overflow",
     [("        s.growth_tracker = 0;\n        return true;", "        return true;")],
     "in a row"),
    ("08", 4, "each rank decides alone",
     [("    pg.all_reduce(&mut flag, ReduceOp::Max)?;\n", "")],
     "agree with one collective"),
    ("08", 4, "inf detected, NaN missed",
     [("bad |= g.isfinite().logical_not().any().int64_value(&[]) != 0;",
       "bad |= g.isinf().any().int64_value(&[]) != 0;")],
     "NaN"),
    ("09", 1, "a recomputed stage still builds its graph",
     [("tch::no_grad(|| model.stage_forward(s, &input, batch))", "model.stage_forward(s, &input, batch)")],
     "keeps only its input"),
    ("09", 1, "the previous output passed on without detaching",
     [("Some((_, prev)) => prev.detach().set_requires_grad(true),", "Some((_, prev)) => prev.shallow_clone(),")],
     "leaf"),
    ("09", 2, "the tied embedding's gradient overwritten, not added",
     [("let _ = params[i].grad().g_add_(g);", "let _ = params[i].grad().copy_(g);")],
     "wte"),
    ("09", 2, "the loss not scaled",
     [("let obj = if s == n - 1 { out * scale }", "let obj = if s == n - 1 { out * 1.0 }")],
     "scale 0.25"),
    ("09", 3, "a block's bytes never freed after its backward",
     [("        alive -= kept(j); // blocks after j are already freed; j's own bytes are counted below\n",
       "")],
     "full"),
    ("09", 4, "the lowest peak instead of the fewest recomputes",
     [(".min_by_key(|&(r, peak, _)| (r, peak))", ".min_by_key(|&(_, peak, _)| peak)")],
     "no recompute"),
    ("10", 1, "the hits walked in the order the pieces were saved",
     [("    hits.sort_unstable();\n", "")],
     "any order"),
    ("10", 1, "dst counted from 0 instead of from the wanted range's start",
     [("dst: lo - want.start,", "dst: lo,")],
     "dst counts from"),
    ("10", 1, "a gap between pieces not detected",
     [("        if lo > next {\n            return Err(format!(\"elements {next}..{lo} are in no saved piece\"));\n        }\n", "")],
     "leaves element 4 out"),
    ("10", 2, "the folder's entries never synced",
     [("    disk.sync(&tmp)?;\n", "")],
     "is missing"),
    ("10", 2, "`latest` overwritten in place",
     [("    disk.write(\"latest.tmp\", name.as_bytes())?;\n    disk.sync(\"latest.tmp\")?;\n    disk.rename(\"latest.tmp\", \"latest\")?;\n",
       "    disk.write(\"latest\", name.as_bytes())?;\n    disk.sync(\"latest\")?;\n")],
     "not a whole checkpoint name"),
    ("10", 2, "the root not synced after the last rename",
     [("    disk.rename(\"latest.tmp\", \"latest\")?;\n    disk.sync(\"\")?;\n", "    disk.rename(\"latest.tmp\", \"latest\")?;\n")],
     "durable"),
    ("10", 2, "a crashed save's .tmp folder left in the way",
     [("    disk.remove_all(&tmp)?;\n", "")],
     "leftover"),
    ("10", 3, "`latest` trusted without looking at the folder",
     [(".and_then(|b| complete(String::from_utf8_lossy(&b).trim()))", ".and_then(|b| step_of(String::from_utf8_lossy(&b).trim()))")],
     "no metadata.json"),
    ("10", 3, "any number of digits taken for a step",
     [("(digits.len() == 8 && digits.bytes().all(|b| b.is_ascii_digit()))", "digits.bytes().all(|b| b.is_ascii_digit())")],
     "8 digits"),
    ("10", 4, "one restart too many",
     [("if generation >= policy.max_restarts {", "if generation > policy.max_restarts {")],
     "restarts are spent"),
    ("10", 4, "one rank fewer whatever the batch",
     [(".find(|w| global % w == 0)", ".find(|_| true)")],
     "do not split over 3"),
    ("11", 1, "the position embedding counted as a matmul",
     [("let n = v * c + l * (12.0 * c * c + 13.0 * c) + 2.0 * c;",
       "let n = v * c + t * c + l * (12.0 * c * c + 13.0 * c) + 2.0 * c;")],
     "besides wpe"),
    ("11", 1, "the attention term left out",
     [("let flops_per_token = 6.0 * n + 12.0 * l * c * t;", "let flops_per_token = 6.0 * n;")],
     "12·L·C·T"),
    ("11", 1, "peak in FLOP/s taken as TFLOP/s",
     [("(devices as f64 * peak_tflops * 1e12)", "(devices as f64 * peak_tflops)")],
     "MFU"),
    ("11", 2, "rank 0's failure not published",
     [("                store.set(key, format!(\"error:{why}\").as_bytes()).map_err(|e| e.to_string())?;\n", "")],
     "must publish its failure"),
    ("11", 2, "the raw id published without its prefix",
     [("store.set(key, &[&b\"id:\"[..], &id[..]].concat())", "store.set(key, &id[..])")],
     "every rank must return rank 0's id"),
    ("11", 2, "a value of any length taken as an id",
     [("        Some(Ok(id)) => Ok(id),\n        _ => Err(format!(\"rank {rank}: {key} is not an NCCL id ({} bytes)\", v.len())),",
       "        Some(Ok(id)) => Ok(id),\n        _ => {\n            let mut id = [0u8; 128];\n            let n = v.len().min(128);\n            id[..n].copy_from_slice(&v[..n]);\n            Ok(id)\n        }")],
     "not an NCCL id"),
    ("11", 3, "always a copy",
     [("    if t.device() == device && t.is_contiguous() {\n        return t.shallow_clone();", "    if t.device() == device && t.is_contiguous() {\n        return t.copy();")],
     "no copy"),
    ("11", 3, "a view on the right device used as it is",
     [("if t.device() == device && t.is_contiguous() {", "if t.device() == device {")],
     "contiguous memory"),
    ("11", 4, "dst rebound to the staged tensor",
     [("        tch::no_grad(|| dst.copy_(staged));", "        *dst = staged.shallow_clone();")],
     "must land in the buffer"),
    ("11", 5, "the step taken on the low-precision parameters",
     [("    opt.step(lr, masters, grad_hosts, decay)?;\n    for (p, m) in params.iter().zip(masters) {",
       "    let working: Vec<Tensor> = params.iter().map(|p| p.to_kind(Kind::Float).reshape([-1])).collect();\n    opt.step(lr, &working, grad_hosts, decay)?;\n    for (m, w) in masters.iter().zip(&working) {\n        tch::no_grad(|| m.shallow_clone().copy_(w));\n    }\n    for (p, m) in params.iter().zip(masters) {")],
     "step the masters"),
    ("11", 5, "the parameter replaced instead of written",
     [("        tch::no_grad(|| p.shallow_clone().copy_(&narrow.reshape(p.size())));",
       "        tch::no_grad(|| p.shallow_clone().set_data(&narrow.reshape(p.size())));")],
     "write into the parameters"),
    ("11", 5, "gradients counted in f32 over the link",
     [("        down += bytes(&moved);", "        down += bytes(h);")],
     "own kind"),
    ("12", 1, "the bias not sliced",
     [("let b_mine = b.narrow(0, rank as i64 * k, k);", "let b_mine = b.narrow(0, 0, k);")],
     "rows of w and of b"),
    ("12", 1, "every rank takes the first rows",
     [("let w_mine = w.narrow(0, rank as i64 * k, k);", "let w_mine = w.narrow(0, 0, k);")],
     "differ from x·wᵀ + b"),
    ("12", 2, "the bias added on every rank, before the sum",
     [("let mut y = x_part.linear::<Tensor>(&w_mine, None); // (N, out): a partial sum", "let mut y = x_part.linear(&w_mine, Some(b));"),
      ("    Ok(y + b)\n}", "    Ok(y)\n}")],
     "the bias added once"),
    ("12", 2, "the partial products not summed",
     [("    pg.all_reduce(&mut y, ReduceOp::Sum)?;\n    Ok(y + b)", "    Ok(y + b)")],
     "partial products summed"),
    ("12", 3, "f backward forgotten: each rank keeps its partial dx",
     [("    pg.all_reduce(&mut dx, ReduceOp::Sum)?;\n", "")],
     "f backward"),
    ("12", 3, "b_proj added inside every rank's partial output",
     [(".linear::<Tensor>(&w2, None); // (N, C)", ".linear(&w2, Some(b_proj));"),
      ("    let y = y + b_proj;\n", "")],
     "the bias once"),
    ("12", 4, "each rank's own row max",
     [("    pg.all_reduce(&mut m, ReduceOp::Max)?;\n", "")],
     "the full cross-entropy is"),
    ("12", 4, "no max subtracted before exp",
     [("let e = (&z - m.unsqueeze(1)).exp();", "let e = z.exp();"),
      ("let loss = ((sum.log() + &m - zt)", "let loss = ((sum.log() - zt)")],
     "row max before exp"),
    ("12", 4, "ignored targets counted in the mean",
     [("let count = valid.sum(Kind::Float).double_value(&[]).max(1.0);", "let count = n as f64;")],
     "not −1"),
    ("13", 1, "a warm-up of p - s forwards",
     [("let warmup = (stages - stage - 1).min(m);", "let warmup = (stages - stage).min(m);")],
     "3 warm-up forwards"),
    ("13", 1, "the last backwards newest first",
     [("ops.extend((b..m).map(Op::Backward));", "ops.extend((b..m).rev().map(Op::Backward));")],
     "3 warm-up forwards"),
    ("13", 2, "a backward waits for its own forward, not the next stage's backward",
     [("                    Op::Backward(i) => b_end[s + 1][i],", "                    Op::Backward(i) => f_end[s][i],")],
     "(op, start, end)"),
    ("13", 2, "a busy stage ignored",
     [("let start = ready.max(free[s]);", "let start = ready;")],
     "(op, start, end)"),
    ("13", 3, "the extra stages to the last ranks",
     [("let n = q + usize::from(r < extra);", "let n = q + usize::from(r >= ranks - extra);")],
     "2, 2, 1, 1"),
    ("13", 3, "more ranks than stages accepted",
     [("if ranks == 0 || ranks > num_stages {", "if ranks == 0 {")],
     "nothing to run"),
    ("14", 1, "characters in order of first appearance",
     [("    v.sort_unstable();\n    v.dedup();\n",
       "    let mut seen = std::collections::HashSet::new();\n    v.retain(|c| seen.insert(*c));\n")],
     "sorted by code point"),
    ("14", 1, "duplicates kept",
     [("    v.dedup();\n", "")],
     "each once"),
    ("14", 1, "an unknown character becomes id 0",
     [("            Err(_) => Err(format!(\"{c:?} is not in the vocabulary\")),", "            Err(_) => Ok(0),")],
     "must be an error"),
    ("14", 1, "calls the library",
     [("    let mut v: Vec<char> = text.chars().collect();\n    v.sort_unstable();\n    v.dedup();\n    v\n",
       "    shardlab::corpus::CharVocab::from_text(text).unwrap().itos\n")],
     "write it yourself"),
    ("14", 1, "bytes, not characters",
     [("    text.chars()\n        .map(|c| match", "    text.bytes().map(|b| b as char)\n        .map(|c| match")],
     "not byte by byte"),
    ("14", 1, "a twin renamed by a use",
     [("    let mut v: Vec<char> = text.chars().collect();\n    v.sort_unstable();\n    v.dedup();\n    v\n",
       "    use shardlab::corpus::CharVocab as Chars;\n    Chars::from_text(text).unwrap().itos\n")],
     "write it yourself"),
    ("14", 2, "the point at a span's end counted in that span",
     [("        if 10 * end > 9 * total {", "        if 10 * end >= 9 * total {")],
     "ends exactly at the 90 % point"),
    ("14", 2, "separators not counted",
     [("let total: usize = lengths.iter().sum::<usize>() + 2 * (lengths.len() - 1);",
       "let total: usize = lengths.iter().sum::<usize>();"),
      ("        end += n + 2;\n", "        end += n;\n")],
     "separators counted"),
    ("14", 2, "the whole text to validation when one document holds 90 %",
     [("            return Ok(i.max(1));", "            return Ok(i);")],
     "train may not be empty"),
    ("14", 2, "validation from the document after the 90 % point",
     [("            return Ok(i.max(1));", "            return Ok((i + 1).min(lengths.len() - 1));")],
     "falls in document 2"),
    ("14", 3, "logits multiplied by the temperature",
     [("logits.iter().map(|x| x / temperature)", "logits.iter().map(|x| x * temperature)")],
     "temperature 0.5 sharpens"),
    ("14", 3, "top-k keeps only what is above the k-th",
     [("        if x >= kth {", "        if x > kth {")],
     "top-k 2 keeps the two largest"),
    ("14", 3, "top-k larger than the vocabulary not clamped",
     [("        Some(k) if k >= 1 && k < z.len() => {", "        Some(k) if k >= 1 => {")],
     "index out of bounds"),
    ("14", 3, "a draw past every cumulative sum returns the last token",
     [("    probs.iter().rposition(|&p| p > 0.0).unwrap_or(0)\n", "    probs.len() - 1\n")],
     "never one of probability 0"),
    ("14", 3, "softmax without subtracting the largest",
     [("            *pi = (x - top).exp();", "            *pi = x.exp();")],
     "must not overflow"),
    ("14", 3, "a draw stops at a cumulative equal to u",
     [("        if cum > u {", "        if cum >= u {")],
     "u = 0.25"),
    ("14", 3, "calls the library",
     [("    let mut cum = 0.0;\n    for (i, p) in probs.iter().enumerate() {",
       "    let l = tch::Tensor::from_slice(probs).log();\n"
       "    let s = shardlab::model::Sampling { temperature: 1.0, top_k: None };\n"
       "    return shardlab::model::sample_next(&l, s, &mut shardlab::rng::Rng::new((u * 1e9) as u64)) as usize;\n"
       "    let mut cum = 0.0;\n    for (i, p) in probs.iter().enumerate() {")],
     "write it yourself"),
    ("14", 4, "scores not scaled by the square root of D",
     [("let scores = q.matmul(&k_all.transpose(-2, -1)) / (d as f64).sqrt();",
       "let scores = q.matmul(&k_all.transpose(-2, -1));")],
     "differs from full causal attention"),
    ("14", 4, "the causal mask of a prompt alone: new tokens blind to the cache",
     [(".tril(t_all - t_new);", ".tril(0);")],
     "differs from full causal attention"),
    ("14", 4, "libtorch's fused attention",
     [("    let y = scores.masked_fill(&allowed.logical_not(), f64::NEG_INFINITY).softmax(-1, scores.kind()).matmul(&v_all);",
       "    let _ = scores;\n    let y = Tensor::scaled_dot_product_attention(q, &k_all, &v_all, Some(&allowed), 0.0, false, None, false);")],
     "write it yourself"),
    ("14", 4, "the cache keeps only the newest tokens",
     [("    *cache = Some((k_all, v_all));", "    *cache = Some((k.shallow_clone(), v.shallow_clone()));")],
     "after 2 tokens the cached keys"),
    ("14", 5, "ZeRO-1 as the ZeRO paper counts it (no averaged gradient shard)",
     [("1 => 8.0 * p + 12.0 * p / n,", "1 => 8.0 * p + 8.0 * p / n,")],
     "ZeRO-1 over 4"),
    ("14", 5, "tensor parallelism divides every parameter",
     [("    let embeddings = wte + shape.block_size as f64 * c;\n",
       "    let embeddings = wte + shape.block_size as f64 * c / t;\n"),
      ("        4.0 * c + (3.0 * c * c + 3.0 * c) / t + c * c / t + c + (4.0 * c * c + 4.0 * c) / t + 4.0 * c * c / t + c;\n",
       "        (4.0 * c + 3.0 * c * c + 3.0 * c + c * c + c + 4.0 * c * c + 4.0 * c + 4.0 * c * c + c) / t;\n")],
     "what does t not divide"),
    ("14", 5, "the tied head's weight not held by the last pipeline rank",
     [("            if at + k == stages.len() && at > 0 {", "            if false {")],
     "pp 4, one entry per pipeline rank"),
    ("14", 5, "the tied head's weight counted twice when one rank holds the whole model",
     [("            if at + k == stages.len() && at > 0 {", "            if at + k == stages.len() {")],
     "16 bytes a parameter"),
    ("14", 5, "the last pipeline ranks take the extra stages",
     [("            let k = q + usize::from(r < extra);", "            let k = q + usize::from(r >= layout.pp - extra);")],
     "pp 4, one entry per pipeline rank"),
    ("14", 5, "calls the library",
     [("    let (c, v, t) = (shape.n_embd as f64, shape.vocab_size as f64, layout.tp as f64);\n",
       "    let cfg = shardlab::model::GptConfig { vocab_size: shape.vocab_size as i64, block_size: shape.block_size as i64,\n"
       "        n_layer: shape.n_layer as i64, n_head: shape.n_head as i64, n_embd: shape.n_embd as i64 };\n"
       "    let dims = shardlab::engine::ParallelDims { dp: layout.dp, tp: layout.tp, pp: layout.pp };\n"
       "    let data = match layout.zero {\n"
       "        0 => shardlab::engine::DataDim::Replicate,\n"
       "        1 => shardlab::engine::DataDim::Zero(shardlab::zero::Stage::One),\n"
       "        2 => shardlab::engine::DataDim::Zero(shardlab::zero::Stage::Two),\n"
       "        _ => shardlab::engine::DataDim::Zero(shardlab::zero::Stage::Three),\n"
       "    };\n"
       "    return shardlab::engine::fit::rank_state_bytes(&cfg, dims, data).unwrap();\n"
       "    let (c, v, t) = (shape.n_embd as f64, shape.vocab_size as f64, layout.tp as f64);\n")],
     "write it yourself"),
    ("14", 5, "the least bytes first, not the least sharding",
     [("    candidates.sort_by_key(|l| (l.tp * l.pp, l.pp, l.zero));", "    candidates.sort_by_key(|l| (3 - l.zero, l.tp * l.pp, l.pp));")],
     "DDP's 16P fits"),
    ("14", 5, "pipeline before tensor parallelism",
     [("    candidates.sort_by_key(|l| (l.tp * l.pp, l.pp, l.zero));", "    candidates.sort_by_key(|l| (l.tp * l.pp, l.tp, l.zero));")],
     "at most 2 replicas"),
    ("14", 5, "the ZeRO stage before tensor over pipeline",
     [("    candidates.sort_by_key(|l| (l.tp * l.pp, l.pp, l.zero));", "    candidates.sort_by_key(|l| (l.tp * l.pp, l.zero, l.pp));")],
     "tensor before pipeline comes before the ZeRO stage"),
    ("14", 5, "a budget of exactly the bytes needed refused",
     [("        if most <= budget {", "        if most < budget {")],
     "fits a budget of exactly 16P"),
    ("14", 5, "more replicas than allowed",
     [("            if dp > max_dp {\n                continue;\n            }\n", "")],
     "at most 2 replicas"),
    ("14", 5, "a bad budget reported as too small",
     [("    if !(budget.is_finite() && budget > 0.0) {", "    if budget.is_infinite() {")],
     "bad input, not a budget too small"),
    ("14", 5, "more pipeline ranks than stages",
     [("(world / tp) % p == 0 && p <= shape.n_layer + 2)", "(world / tp) % p == 0)")],
     "leaves a rank empty"),
    ("14", 5, "tp not checked against the vocabulary",
     [("shape.n_head % t == 0 && shape.vocab_size % t == 0)", "shape.n_head % t == 0)")],
     "vocabulary of 85"),
    ("14", 5, "only the first rank checked against the budget",
     [("        let most = rank_state_bytes(shape, &l).into_iter().fold(0.0, f64::max);",
       "        let most = rank_state_bytes(shape, &l)[0];")],
     "but its second 203264"),
    ("14", 5, "the error does not say what the smallest layout needs",
     [('        Some((b, l)) => format!("nothing fits {budget:.0} bytes a rank: the smallest layout, {l:?}, needs {b:.0}"),',
       '        Some((b, l)) => format!("nothing fits {budget:.0} bytes a rank"),')],
     "say (in bytes) what the smallest layout needs"),
    ("15", 1, "plain least squares: the largest message decides the intercept",
     [("        let w = 1.0 / (t * t);", "        let w = 1.0;")],
     "relative error over every point"),
    ("15", 1, "weights of 1/t: the relative error not squared",
     [("        let w = 1.0 / (t * t);", "        let w = 1.0 / t;")],
     "what weight on"),
    ("15", 1, "weights of 1/B: every size alike, but not every time",
     [("        let w = 1.0 / (t * t);", "        let w = 1.0 / b;")],
     "what weight on"),
    ("15", 1, "the ring's 2(n - 1)/n left out of β",
     [("    Ok((a / steps, steps / n / c))", "    Ok((a / steps, 1.0 / c))")],
     "on n ranks the ring has"),
    ("15", 1, "α not shared over the ring's steps",
     [("    Ok((a / steps, steps / n / c))", "    Ok((a, steps / n / c))")],
     "on 2 ranks gave"),
    ("15", 1, "times that fall with the size accepted",
     [("    if c <= 0.0 {", "    if false {")],
     "not a negative"),
    ("15", 1, "calls the library",
     [("    if points.len() < 2 || ranks < 2 {", "    return shardlab::sim::calibrate::fit_all_reduce(points, ranks);\n    if points.len() < 2 || ranks < 2 {")],
     "write it yourself"),
    ("15", 2, "NVLink's latency across nodes",
     [("        (nic.alpha, nvlink.bytes_per_s.min(per_node as f64 * nic.bytes_per_s))",
       "        (nvlink.alpha, nvlink.bytes_per_s.min(per_node as f64 * nic.bytes_per_s))")],
     "one per node"),
    ("15", 2, "one NIC for a whole node",
     [("        (nic.alpha, nvlink.bytes_per_s.min(per_node as f64 * nic.bytes_per_s))",
       "        (nic.alpha, nic.bytes_per_s)")],
     "8 × 23 GB/s"),
    ("15", 2, "the NICs not bounded by NVLink",
     [("        (nic.alpha, nvlink.bytes_per_s.min(per_node as f64 * nic.bytes_per_s))",
       "        (nic.alpha, per_node as f64 * nic.bytes_per_s)")],
     "40 GB/s NICs"),
    ("15", 2, "the bandwidth term without (n - 1)/n",
     [("    2.0 * (n - 1.0) * alpha + 2.0 * (n - 1.0) / n * bytes / bus", "    2.0 * (n - 1.0) * alpha + 2.0 * bytes / bus")],
     "8 GPUs in one node"),
    ("15", 2, "calls the library",
     [("    if gpus <= 1 {\n        return 0.0;", "    let _ = shardlab::sim::Placement { size: gpus, per_node };\n    if gpus <= 1 {\n        return 0.0;")],
     "write it yourself"),
    ("15", 3, "one chunk warmed up like the interleaved schedule",
     [("if v == 1 { p - rank - 1 } else {", "if false { 0 } else {")],
     "plain 1F1B"),
    ("15", 3, "backwards through the chunks in the forwards' order",
     [("        let chunk = if forward { chunk } else { v - 1 - chunk };", "        let chunk = if forward { chunk } else { chunk };")],
     "rank 0 of 2 with 2 chunks"),
    ("15", 3, "a warm-up without the (v - 1)·p forwards of the other chunks",
     [("(p - rank - 1) * 2 + (v - 1) * p", "(p - rank - 1) * 2")],
     "rank 0 of 2 with 2 chunks"),
    ("15", 3, "the warm-up's two per later rank taken as p",
     [("(p - rank - 1) * 2 + (v - 1) * p", "(p - rank - 1) * p + (v - 1) * p")],
     "rank 2 of 4 with 3 chunks"),
    ("15", 3, "one chunk's warm-up not capped at the micro-batches",
     [("    let warmup = if v == 1 { p - rank - 1 } else { (p - rank - 1) * 2 + (v - 1) * p }.min(total);",
       "    let warmup = if v == 1 { p - rank - 1 } else { ((p - rank - 1) * 2 + (v - 1) * p).min(total) };")],
     "overflow"),
    ("15", 3, "micro-batches that do not fill the groups accepted",
     [("    if v > 1 && m % p != 0 {", "    if false {")],
     "cannot go in groups of 2"),
    ("15", 3, "calls the library",
     [("    let (p, v, m) = (stages, chunks, micro_batches);\n    if p == 0",
       "    let _ = shardlab::pipeline::interleaved(stages, chunks, micro_batches, rank);\n    let (p, v, m) = (stages, chunks, micro_batches);\n    if p == 0")],
     "write it yourself"),
    ("15", 4, "the ring's latency paid once per step, not per bucket",
     [("    let seconds = buckets.len() as f64 * 2.0 * (n - 1.0) * link.alpha + share * bytes / link.bytes_per_s;",
       "    let seconds = 2.0 * (n - 1.0) * link.alpha + share * bytes / link.bytes_per_s;")],
     "every all-reduce pays"),
    ("15", 4, "α for the reduce-scatter only: n - 1 steps",
     [("    let seconds = buckets.len() as f64 * 2.0 * (n - 1.0) * link.alpha + share * bytes / link.bytes_per_s;",
       "    let seconds = buckets.len() as f64 * (n - 1.0) * link.alpha + share * bytes / link.bytes_per_s;")],
     "2(n − 1) steps of α"),
    ("15", 4, "each rank sends (n - 1)/n: the reduce-scatter only",
     [("    let share = 2.0 * (n - 1.0) / n;", "    let share = (n - 1.0) / n;")],
     "each rank sends 2(n − 1)/n"),
    ("15", 4, "the bytes of every rank together",
     [("    Ok(StepComm { messages: buckets.len(), bytes_per_rank: share * bytes, seconds })",
       "    Ok(StepComm { messages: buckets.len(), bytes_per_rank: share * n * bytes, seconds })")],
     "each rank sends 2(n − 1)/n"),
    ("15", 4, "a bucket that reaches the cap exactly closed early",
     [("        if open > 0 && open + b > cap {", "        if open > 0 && open + b >= cap {")],
     "exactly full"),
    ("15", 4, "one bucket per parameter",
     [("        if open > 0 && open + b > cap {", "        if open > 0 {")],
     "one per bucket"),
    ("15", 4, "one rank still all-reduces",
     [("    if ranks == 1 {\n        return Ok(StepComm { messages: 0, bytes_per_rank: 0.0, seconds: 0.0 });\n    }\n", "")],
     "one rank"),
    ("15", 4, "calls the library",
     [("    // The buckets, walking from the last parameter to the first (lesson 05).",
       "    let _ = shardlab::ddp::assign_buckets(param_bytes, cap);\n    // The buckets, walking from the last parameter to the first (lesson 05).")],
     "write it yourself"),
]


def slug_of(nn):
    for d in sorted(os.listdir("lessons")):
        if d.startswith(nn + "_"):
            return d
    sys.exit(f"wrong_answers: no lessons/{nn}_*")


def failure_sections(log):
    """{test name: its failure messages} from libtest's report, without the quiet panic hook's
    `(panicked in <test name> at …)` lines: a reason must come from the grader's message, never
    from the name of the test that failed."""
    parts = re.split(r"^---- (\S+) stdout ----$", log, flags=re.M)
    out = {}
    for name, text in zip(parts[1::2], parts[2::2]):
        text = text.split("\nfailures:\n")[0]
        out[name] = re.sub(r"^\s*\(panicked in [^\n]*\)$\n?", "", text, flags=re.M)
    return out


def main():
    only = set(sys.argv[1:])
    by_lesson = defaultdict(list)
    for w in WRONG:
        if not only or w[0] in only:
            by_lesson[w[0]].append(w)
    failed = []
    for nn, wrongs in sorted(by_lesson.items()):
        slug = slug_of(nn)
        solution = open(f"solutions/{slug}.rs").read()
        exercise_path = f"lessons/{slug}/exercise.rs"
        original = open(exercise_path).read()
        # Rounds: at most one mistake per exercise in each build.
        rounds = []
        for w in wrongs:
            for r in rounds:
                if all(x[1] != w[1] for x in r):
                    r.append(w)
                    break
            else:
                rounds.append([w])
        try:
            for r in rounds:
                src = solution
                for (_, k, mistake, edits, _) in r:
                    for find, repl in edits:
                        if src.count(find) != 1:
                            sys.exit(f"wrong_answers: lesson {nn} ex{k} ({mistake}): {find!r} is not in "
                                     f"solutions/{slug}.rs exactly once — update .ci/wrong_answers.py")
                        src = src.replace(find, repl)
                with open(exercise_path, "w") as f:
                    f.write(src)
                env = dict(os.environ, SHARDLAB_GRADE="strict", SHARDLAB_NO_EXIT_TABLE="1")
                p = subprocess.run(["cargo", "test", "--quiet", "--test", f"lesson{nn}", "exercise::"],
                                   env=env, capture_output=True, text=True)
                log = p.stdout + p.stderr
                if "could not compile" in log:
                    print(log)
                    sys.exit(f"wrong_answers: lesson {nn}: a wrong answer does not compile")
                sections = failure_sections(log)
                for (_, k, mistake, _, expect) in r:
                    mine = {t: s for t, s in sections.items() if re.search(rf"::ex{k}_", t)}
                    if not mine:
                        failed.append(f"lesson {nn} ex{k}: the grader PASSED a wrong answer ({mistake})")
                    elif not any(expect in s for s in mine.values()):
                        failed.append(f"lesson {nn} ex{k}: caught ({mistake}) but no message says {expect!r}:\n"
                                      + "\n".join(mine.values()))
                    else:
                        print(f"wrong_answers: lesson {nn} ex{k}: caught '{mistake}'")
        finally:
            with open(exercise_path, "w") as f:
                f.write(original)
    if failed:
        print("\n".join(failed))
        sys.exit(f"wrong_answers: {len(failed)} wrong answer(s) not caught as they should be")
    print(f"wrong_answers: all {sum(len(v) for v in by_lesson.values())} wrong answers caught")


if __name__ == "__main__":
    main()
