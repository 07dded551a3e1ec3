//! The GPT against PyTorch: checkpoints cross between shardlab and a nanoGPT-architecture model in
//! PyTorch (`benches/torch_gpt.py`, loaded with `load_state_dict(strict=True)`) and give the same
//! eval loss on the same tokens; plus the strictness of our own loader.

use shardlab::data::synthetic_corpus;
use shardlab::model::{Gpt, GptConfig, Model};
use std::path::{Path, PathBuf};
use std::process::Command;
use tch::Tensor;

const SHAPE: [&str; 10] =
    ["--n-layer", "2", "--n-head", "2", "--n-embd", "64", "--block-size", "32", "--vocab-size", "64"];

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("shardlab-model-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d.join(name)
}

fn json_field(out: &std::process::Output, key: &str) -> f64 {
    assert!(out.status.success(), "command failed: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().rev().find(|l| l.contains(key)).unwrap_or_else(|| panic!("no {key} in {text}"));
    let v: serde_json::Value = serde_json::from_str(line).unwrap();
    v[key].as_f64().unwrap()
}

fn python() -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/python");
    assert!(p.exists(), "{} is missing: run `bash .ci/setup` (it installs PyTorch and safetensors)", p.display());
    p
}

fn torch_gpt(args: &[&str]) -> std::process::Output {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/torch_gpt.py");
    Command::new(python()).arg("-W").arg("ignore").arg(script).args(SHAPE).args(args).output().unwrap()
}

fn ours(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_train")).args(SHAPE).args(args).env("RUST_BACKTRACE", "0").output().unwrap()
}

#[test]
fn checkpoints_cross_to_pytorch_and_back_with_the_same_loss() {
    let data = tmp("corpus.bin");
    synthetic_corpus(20_000, 5).write(&data).unwrap();
    let d = data.to_str().unwrap();

    // shardlab trains and saves; PyTorch (strict load) and shardlab evaluate the same windows.
    let w = tmp("ours.safetensors");
    let out = ours(&["--steps", "20", "--warmup", "2", "--lr", "3e-3", "--save", w.to_str().unwrap(), "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let a = json_field(&torch_gpt(&["eval", "--weights", w.to_str().unwrap(), "--data", d]), "eval_loss");
    let b = json_field(&ours(&["--eval-only", "--init", w.to_str().unwrap(), "--data", d, "--json"]), "eval_loss");
    assert!((a - b).abs() < 1e-5, "trained by shardlab: PyTorch eval {a}, shardlab eval {b}");
    assert!(b < 3.0, "20 steps on the arithmetic corpus should beat uniform (ln 64 = 4.16): {b}");

    // PyTorch initialises and saves; shardlab loads it and agrees.
    let w2 = tmp("theirs.safetensors");
    let out = torch_gpt(&["init", "--out", w2.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let a = json_field(&torch_gpt(&["eval", "--weights", w2.to_str().unwrap(), "--data", d]), "eval_loss");
    let b = json_field(&ours(&["--eval-only", "--init", w2.to_str().unwrap(), "--data", d, "--json"]), "eval_loss");
    assert!((a - b).abs() < 1e-5, "initialised by PyTorch: PyTorch eval {a}, shardlab eval {b}");
}

#[test]
fn names_shapes_and_count_follow_nanogpt() {
    let cfg = GptConfig::tiny();
    let m = Gpt::new(cfg, 0).unwrap();
    let names: Vec<String> = m.state_dict().into_iter().map(|(n, _)| n).collect();
    assert_eq!(names[0], "transformer.wte.weight");
    assert_eq!(names[4], "transformer.h.0.attn.c_attn.weight");
    assert_eq!(names.last().unwrap(), "lm_head.weight");
    assert_eq!(names.len(), 2 + 12 * cfg.n_layer as usize + 2 + 1);
    assert_eq!(m.num_params(), cfg.num_params());
    // nanoGPT init: weights std 0.02, residual projections 0.02/sqrt(2 n_layer).
    let sd: std::collections::HashMap<String, Tensor> = m.state_dict().into_iter().collect();
    let big = Gpt::new(GptConfig::bench(), 0).unwrap();
    let bsd: std::collections::HashMap<String, Tensor> = big.state_dict().into_iter().collect();
    let std = |t: &Tensor| t.std(true).double_value(&[]);
    assert!((std(&bsd["transformer.wte.weight"]) - 0.02).abs() < 2e-4);
    assert!((std(&bsd["transformer.h.1.mlp.c_proj.weight"]) - 0.02 / 8f64.sqrt()).abs() < 2e-4);
    assert_eq!(sd["transformer.h.0.ln_1.weight"].sum(tch::Kind::Float).double_value(&[]), cfg.n_embd as f64);
}

#[test]
fn loader_is_strict_and_ties_a_missing_lm_head() {
    let cfg = GptConfig::tiny();
    let a = Gpt::new(cfg, 1).unwrap();
    let b = Gpt::new(cfg, 2).unwrap();
    let same = |x: &Gpt, y: &Gpt| x.parameters().iter().zip(y.parameters()).all(|(p, q)| p.equal(&q));
    let save = |name: &str, sd: Vec<(String, Tensor)>| {
        let p = tmp(name);
        Tensor::write_safetensors(&sd, &p).unwrap();
        p
    };
    // Round trip.
    let p = tmp("a.safetensors");
    a.save_safetensors(&p).unwrap();
    b.load_safetensors(&p).unwrap();
    assert!(same(&a, &b));
    // Without lm_head.weight: tied to wte.
    let c = Gpt::new(cfg, 3).unwrap();
    let no_head =
        save("nohead.safetensors", a.state_dict().into_iter().filter(|(n, _)| n != "lm_head.weight").collect());
    c.load_safetensors(&no_head).unwrap();
    assert!(same(&a, &c));
    // Missing, unexpected, mis-shaped and untied keys are refused, naming the key; nothing is loaded.
    let d = Gpt::new(cfg, 4).unwrap();
    let before: Vec<Tensor> = d.parameters().iter().map(|t| t.copy()).collect();
    let cases: Vec<(&str, Vec<(String, Tensor)>, &str)> = vec![
        (
            "missing",
            a.state_dict().into_iter().filter(|(n, _)| n != "transformer.ln_f.bias").collect(),
            "missing key transformer.ln_f.bias",
        ),
        (
            "extra",
            {
                let mut v = a.state_dict();
                v.push(("foo.weight".into(), Tensor::zeros([2], tch::kind::FLOAT_CPU)));
                v
            },
            "unexpected key foo.weight",
        ),
        (
            "shape",
            a.state_dict()
                .into_iter()
                .map(|(n, t)| if n == "transformer.wpe.weight" { (n, t.narrow(0, 0, 3)) } else { (n, t) })
                .collect(),
            "transformer.wpe.weight: shape",
        ),
        (
            "untied",
            a.state_dict()
                .into_iter()
                .map(|(n, t)| if n == "lm_head.weight" { (n, t.zeros_like()) } else { (n, t) })
                .collect(),
            "lm_head.weight differs",
        ),
    ];
    for (name, sd, want) in cases {
        let p = save(&format!("{name}.safetensors"), sd.into_iter().map(|(n, t)| (n, t.contiguous())).collect());
        let e = d.load_safetensors(&p).unwrap_err().to_string();
        assert!(e.contains(want), "{name}: error should mention `{want}`: {e}");
    }
    assert!(d.parameters().iter().zip(&before).all(|(p, q)| p.equal(q)), "a refused file must not change the model");
    // Bigger model's file into a smaller model: refused.
    let e = Gpt::new(GptConfig { n_layer: 1, ..cfg }, 0).unwrap().load_safetensors(&p).unwrap_err().to_string();
    assert!(e.contains("unexpected key transformer.h.1"), "{e}");
}
