//! The executor: one pipelined forward and backward of a batch over the pipeline's ranks
//! ([`pipeline_step`]), activations and their gradients sent point to point between neighbours in
//! the order a [`Schedule`](super::Schedule) gives, each rank running only its model stages.

use super::{check, schedule, Op, Schedule, Slot};
use crate::comm::{CommError, CommResult, ProcessGroup};
use crate::model::{Batch, Model};
use std::collections::BTreeMap;
use std::ops::Range;
use std::time::Instant;
use tch::{Kind, Tensor};

/// The model stages (`0..num_stages`: for the GPT, the embeddings, each block, the head and loss)
/// of each of `ranks` pipeline ranks: contiguous, as equal as they divide (the first ranks take
/// one more). More ranks than stages is an error.
pub fn partition(num_stages: usize, ranks: usize) -> Result<Vec<Range<usize>>, String> {
    if ranks == 0 || ranks > num_stages {
        return Err(format!("{ranks} pipeline ranks for a model of {num_stages} stages: each rank needs at least one"));
    }
    let (q, extra) = (num_stages / ranks, num_stages % ranks);
    let mut out = Vec::new();
    let mut lo = 0;
    for r in 0..ranks {
        let n = q + usize::from(r < extra);
        out.push(lo..lo + n);
        lo += n;
    }
    Ok(out)
}

/// What one pipelined step did on this rank.
pub struct PipelineStep {
    /// The batch's mean loss (over its micro-batches; the same on every rank).
    pub loss: f64,
    /// Gradients of the parameters this rank's stages use (by index in the model's
    /// `named_parameters`), summed over micro-batches — tied parameters used on several ranks
    /// (the GPT's embedding, also its output head) summed over those ranks too.
    pub grads: BTreeMap<usize, Tensor>,
    /// When each of this rank's operations computed (seconds from the step's start; from after
    /// the receive it waited for to before its send), in schedule order: the pipeline diagram,
    /// measured. `Slot::stage` is the pipeline rank.
    pub slots: Vec<Slot>,
    /// The most micro-batches whose activations this rank held at once (under
    /// [`interleaved_step`](super::interleaved_step), chunk forwards whose backward had not run).
    pub peak_in_flight: usize,
    /// The step's duration on this rank (seconds).
    pub step_s: f64,
}

impl PipelineStep {
    /// This rank's idle fraction of its step: 1 − busy / step time.
    pub fn bubble(&self) -> f64 {
        let busy: f64 = self.slots.iter().map(|s| s.end - s.start).sum();
        1.0 - busy / self.step_s
    }
}

/// One training step's forward and backward of `model` as a pipeline over `pg` (rank r runs the
/// stages `partition(…)[r]`), `batch` cut into `micro_batches` equal micro-batches, in the order
/// `kind` gives. Activations (rows, T, `hidden`) f32 go forward to the next rank and their
/// gradients come back, point to point. Every rank builds the same `model` (the same seed) and
/// computes only its stages. Bad shapes are errors on every rank before anything is computed.
pub fn pipeline_step(
    pg: &ProcessGroup,
    model: &dyn Model,
    kind: Schedule,
    batch: &Batch,
    micro_batches: usize,
    hidden: i64,
) -> CommResult<PipelineStep> {
    pipeline_step_with(pg, model, kind, batch, micro_batches, hidden, false)
}

/// [`pipeline_step`], with activation checkpointing when `recompute`: each micro-batch's forward
/// through this rank's stages runs without a graph, keeping only its input (the received
/// activation; on the first rank, the batch's rows), and runs again with a graph just before its
/// backward — the same operations on the same values, so the same gradients bitwise, for one more
/// forward of the rank's stages. Megatron's full recompute at the granularity of a pipeline rank.
pub fn pipeline_step_with(
    pg: &ProcessGroup,
    model: &dyn Model,
    kind: Schedule,
    batch: &Batch,
    micro_batches: usize,
    hidden: i64,
    recompute: bool,
) -> CommResult<PipelineStep> {
    let (p, r) = (pg.world_size(), pg.rank());
    let parts =
        partition(model.num_stages(), p).map_err(|m| CommError::InvalidArgument(format!("rank {r}: pipeline: {m}")))?;
    let mut runner = Autograd::new(model, parts[r].clone(), hidden, recompute);
    run_pipeline(pg, &mut runner, &model.stage_uses(), kind, batch, micro_batches)
}

/// The stages `mine` of `model` as a [`StageRunner`] with autograd, activations of width `hidden`:
/// what [`pipeline_step`] runs on each rank, for an executor of one's own (lesson 13, exercise 4).
pub fn model_runner<'m>(model: &'m dyn Model, mine: Range<usize>, hidden: i64) -> impl StageRunner + 'm {
    Autograd::new(model, mine, hidden, false)
}

/// What a pipeline rank computes, one micro-batch at a time: the forward and backward of its
/// stages. The executor ([`run_pipeline`]) moves the activations and their gradients between the
/// ranks in the schedule's order. [`pipeline_step`] runs a [`Model`]'s stages with autograd; a
/// tensor-parallel GPT's stages run their own backward (3-D parallelism, `crate::engine`).
pub trait StageRunner {
    /// The forward of micro-batch `mb` (its rows: `part`) through this rank's stages, from `x`,
    /// the activation received from the previous rank (undefined on the first): the activation
    /// to send on, or on the last rank the micro-batch's mean loss (a scalar).
    fn forward(&mut self, mb: usize, x: Tensor, part: &Batch) -> CommResult<Tensor>;
    /// The backward of micro-batch `mb` from `g_out`, the gradient of its output (on the last
    /// rank the loss's weight, a scalar): this rank's parameter gradients (by index in the
    /// model's `named_parameters`) and dL/dx to send back (none on the first rank).
    fn backward(
        &mut self,
        mb: usize,
        g_out: &Tensor,
        part: &Batch,
    ) -> CommResult<(Vec<(usize, Tensor)>, Option<Tensor>)>;
    /// The shape of the (f32) activations between ranks for a micro-batch of `rows` rows of `t`
    /// tokens.
    fn activation(&self, rows: i64, t: i64) -> Vec<i64>;
}

/// A [`Model`]'s stages, with autograd: forward keeps each micro-batch's graph (or, recomputing,
/// its input only), backward runs it from the received gradient.
struct Autograd<'m> {
    model: &'m dyn Model,
    mine: Range<usize>,
    params: Vec<Tensor>,
    my_params: Vec<usize>,
    recompute: bool,
    hidden: i64,
    /// Per micro-batch in flight: the input leaf (none on the first rank) and the output with its
    /// graph (none when recomputed).
    saved: BTreeMap<usize, (Option<Tensor>, Option<Tensor>)>,
}

impl<'m> Autograd<'m> {
    fn new(model: &'m dyn Model, mine: Range<usize>, hidden: i64, recompute: bool) -> Self {
        let uses = model.stage_uses();
        let mut my_params: Vec<usize> = mine.clone().flat_map(|s| uses[s].iter().copied()).collect();
        my_params.sort_unstable();
        my_params.dedup();
        Autograd { model, mine, params: model.parameters(), my_params, recompute, hidden, saved: BTreeMap::new() }
    }
    fn chain(&self, x_leaf: &Option<Tensor>, part: &Batch) -> Tensor {
        let mut x = x_leaf.as_ref().map_or_else(Tensor::new, |x| x.shallow_clone());
        for s in self.mine.clone() {
            x = self.model.stage_forward(s, &x, part);
        }
        x
    }
}

impl StageRunner for Autograd<'_> {
    fn forward(&mut self, mb: usize, x: Tensor, part: &Batch) -> CommResult<Tensor> {
        let x_leaf = (self.mine.start > 0).then(|| x.set_requires_grad(true));
        let out = if self.recompute { tch::no_grad(|| self.chain(&x_leaf, part)) } else { self.chain(&x_leaf, part) };
        // Recomputed: keep the input only (the output, without a graph, is not kept).
        self.saved.insert(mb, (x_leaf, (!self.recompute).then(|| out.shallow_clone())));
        Ok(out)
    }
    fn backward(
        &mut self,
        mb: usize,
        g_out: &Tensor,
        part: &Batch,
    ) -> CommResult<(Vec<(usize, Tensor)>, Option<Tensor>)> {
        let (x_leaf, out) = self
            .saved
            .remove(&mb)
            .ok_or_else(|| CommError::InvalidArgument(format!("backward of micro-batch {mb} before its forward")))?;
        // Recomputed: the forward again, now with a graph, from the kept input.
        let out = out.unwrap_or_else(|| self.chain(&x_leaf, part));
        let mut wrt: Vec<&Tensor> = self.my_params.iter().map(|&k| &self.params[k]).collect();
        if let Some(x) = &x_leaf {
            wrt.push(x);
        }
        let surrogate = (&out * g_out).sum(Kind::Float);
        let mut g = Tensor::run_backward(&[&surrogate], &wrt, false, false);
        let dx = x_leaf.is_some().then(|| g.pop().expect("dL/dx"));
        Ok((self.my_params.iter().copied().zip(g).collect(), dx))
    }
    fn activation(&self, rows: i64, t: i64) -> Vec<i64> {
        vec![rows, t, self.hidden]
    }
}

/// Abort `pg` with `e` (so that no neighbour waits for this rank), returned.
fn fail(pg: &ProcessGroup, e: CommError) -> CommError {
    pg.abort(&format!("rank {}: pipeline stage: {e}", pg.rank()));
    e
}

/// One training step's forward and backward over the pipeline `pg`: `runner` computes this rank's
/// stages (`uses`: the parameters each of the model's stages uses, the same on every rank, for
/// the tied parameters' exchange), `batch` cut into `micro_batches` equal micro-batches, in the
/// order `kind` gives. Bad shapes are errors on every rank before anything is computed.
pub fn run_pipeline(
    pg: &ProcessGroup,
    runner: &mut dyn StageRunner,
    uses: &[Vec<usize>],
    kind: Schedule,
    batch: &Batch,
    micro_batches: usize,
) -> CommResult<PipelineStep> {
    let (p, r) = (pg.world_size(), pg.rank());
    let bad = |m: String| CommError::InvalidArgument(format!("rank {r}: pipeline: {m}"));
    let parts = partition(uses.len(), p).map_err(bad)?;
    check(p, micro_batches).map_err(bad)?;
    let (mb, t, weight) = micro_batch_weights(batch, micro_batches).map_err(bad)?;
    let last = r + 1 == p;
    // Which parameters each rank's stages use.
    let used_by = |q: usize| -> Vec<usize> {
        let mut v: Vec<usize> = parts[q].clone().flat_map(|s| uses[s].iter().copied()).collect();
        v.sort_unstable();
        v.dedup();
        v
    };
    let mut grads: BTreeMap<usize, Tensor> = BTreeMap::new();
    let mut in_flight = vec![false; micro_batches];
    let (mut held, mut peak, mut losses) = (0usize, 0usize, 0.0f64);
    let shape = runner.activation(mb, t);
    let act = || Tensor::zeros(shape.as_slice(), (Kind::Float, batch.x.device()));
    // A send may block until the receiver reads (a full socket or shared-memory ring; NCCL always
    // waits for its peer). Two neighbours that both send first deadlock: in 1F1B's steady state
    // rank r sends activation i while rank r + 1 sends it gradient j. So rank r holds an
    // activation back until it has received the gradient that rank r + 1 sends before reading
    // that activation (Megatron pairs them in one send_forward_recv_backward).
    let next_plan = if last { Vec::new() } else { schedule(kind, p, micro_batches, r + 1) };
    let pos = |op: Op| next_plan.iter().position(|&o| o == op);
    let mut held_back: Vec<(usize, Tensor)> = Vec::new(); // (micro-batch, activation) not yet sent
    pg.barrier()?;
    let t0 = Instant::now();
    let mut slots = Vec::new();
    let plan = schedule(kind, p, micro_batches, r);
    for (n, &op) in plan.iter().enumerate() {
        // The slot is the compute: from after the receive that op waits for to before its send
        // (waiting for a neighbour is the bubble, not work).
        let (start, end);
        match op {
            Op::Forward(i) => {
                let part = batch.rows(i as i64 * mb, (i as i64 + 1) * mb);
                let x = if r == 0 {
                    Tensor::new()
                } else {
                    let mut x = act();
                    pg.recv(&mut x, r - 1)?; // (mb, T, hidden) from the previous stage
                    x
                };
                start = t0.elapsed().as_secs_f64();
                // A runner's error aborts the pipeline: its neighbours wait on it in recv.
                let x = runner.forward(i, x, &part).map_err(|e| fail(pg, e))?;
                end = t0.elapsed().as_secs_f64();
                if last {
                    losses += x.double_value(&[]) * weight[i];
                } else {
                    if x.size() != shape || x.kind() != Kind::Float {
                        let e =
                            format!("stage output {:?} {:?}, but the pipeline sends {shape:?} f32", x.size(), x.kind());
                        pg.abort(&e);
                        return Err(bad(e));
                    }
                    // Our next backward's gradient comes from rank r + 1; if it sends that before
                    // reading this activation, receive it first (at that backward).
                    let next_b = plan[n + 1..].iter().find(|o| matches!(o, Op::Backward(_))).copied();
                    let theirs_first = next_b.is_some_and(|b| pos(b) < pos(Op::Forward(i)));
                    if theirs_first {
                        held_back.push((i, x.detach()));
                    } else {
                        pg.send(&x.detach(), r + 1)?;
                    }
                }
                in_flight[i] = true;
                held += 1;
                peak = peak.max(held);
            }
            Op::Backward(i) => {
                if !std::mem::take(&mut in_flight[i]) {
                    return Err(bad(format!("backward of micro-batch {i} before its forward")));
                }
                let g_out = if last {
                    // The batch's mean over its targets: micro-batch i weighs its share of them.
                    Tensor::from(weight[i]).to_kind(Kind::Float)
                } else {
                    let mut g = act();
                    pg.recv(&mut g, r + 1)?; // dL/d(our output) from the next stage
                                             // Now the activations held back for this gradient can go.
                    for (_, a) in held_back.drain(..) {
                        pg.send(&a, r + 1)?;
                    }
                    g
                };
                start = t0.elapsed().as_secs_f64();
                let part = batch.rows(i as i64 * mb, (i as i64 + 1) * mb);
                let (g, dx) = runner.backward(i, &g_out, &part).map_err(|e| fail(pg, e))?;
                end = t0.elapsed().as_secs_f64();
                if let Some(dx) = dx {
                    pg.send(&dx, r - 1)?;
                }
                accumulate(&mut grads, g);
                held -= 1;
            }
        }
        slots.push(Slot { stage: r, op, start, end });
    }
    let step_s = t0.elapsed().as_secs_f64();
    let used: Vec<Vec<usize>> = (0..p).map(used_by).collect();
    sum_tied(pg, &mut grads, &used)?;
    // The loss from the last rank to everyone.
    let mut l = Tensor::from_slice(&[if last { losses } else { 0.0 }]);
    pg.broadcast(&mut l, p - 1)?;
    Ok(PipelineStep { loss: l.double_value(&[0]), grads, slots, peak_in_flight: peak, step_s })
}

/// A batch cut into `micro_batches` equal micro-batches: their rows, the tokens a row, and each
/// one's weight in the batch's loss. The GPT's loss is the mean over targets other than −1:
/// micro-batch i's mean weighs (its targets) / (the batch's), so that the step's loss is the
/// batch's mean. Every rank has the batch: no communication.
pub(super) fn micro_batch_weights(batch: &Batch, micro_batches: usize) -> Result<(i64, i64, Vec<f64>), String> {
    let (rows, t) = batch.x.size2().map_err(|e| format!("batch (B, T): {e}"))?;
    if rows % micro_batches as i64 != 0 {
        return Err(format!("{micro_batches} micro-batches do not divide a batch of {rows} rows"));
    }
    let mb = rows / micro_batches as i64;
    let counts: Vec<f64> = (0..micro_batches as i64)
        .map(|i| batch.y.narrow(0, i * mb, mb).ne(-1).sum(Kind::Int64).int64_value(&[]) as f64)
        .collect();
    if let Some(i) = counts.iter().position(|&c| c == 0.0) {
        return Err(format!("micro-batch {i} has no target (all −1): its mean loss is undefined"));
    }
    let total: f64 = counts.iter().sum();
    Ok((mb, t, counts.iter().map(|c| c / total).collect()))
}

/// Add one micro-batch's parameter gradients (by parameter index) into the step's sums.
pub(super) fn accumulate(grads: &mut BTreeMap<usize, Tensor>, g: impl IntoIterator<Item = (usize, Tensor)>) {
    for (k, gk) in g {
        match grads.get_mut(&k) {
            Some(acc) => drop(acc.g_add_(&gk)),
            None => drop(grads.insert(k, gk)),
        }
    }
}

/// Tied parameters used on several ranks (`used[q]`: the parameters rank q's stages use): the
/// lowest user collects the others' gradients, sums them and sends the sum back (the GPT's
/// embedding: the first and the last rank).
pub(super) fn sum_tied(pg: &ProcessGroup, grads: &mut BTreeMap<usize, Tensor>, used: &[Vec<usize>]) -> CommResult<()> {
    let r = pg.rank();
    let n_params = used.iter().flatten().map(|&k| k + 1).max().unwrap_or(0);
    for k in 0..n_params {
        let users: Vec<usize> = (0..used.len()).filter(|&q| used[q].contains(&k)).collect();
        if users.len() < 2 || !users.contains(&r) {
            continue;
        }
        let g = grads.get_mut(&k).expect("a used parameter has a gradient");
        if r == users[0] {
            for &q in &users[1..] {
                let mut other = Tensor::zeros_like(g);
                pg.recv(&mut other, q)?;
                let _ = g.g_add_(&other);
            }
            for &q in &users[1..] {
                pg.send(g, q)?;
            }
        } else {
            pg.send(g, users[0])?;
            pg.recv(g, users[0])?;
        }
    }
    Ok(())
}
