//! Grader for lesson 11 (GPUs, NCCL, multi-node and offload).
//!
//! Written once, run twice (`shardlab::graders!`): `solution::exK_…` against the reference answers in
//! `solutions/`, `exercise::exK_…` against your `lessons/11_gpus_nccl/exercise.rs`.
//! `cargo test` skips exercises you have not started; `cargo grade 11` grades them all strictly.
//! A test named `exK_…` grades exercise K; its failure message says what went wrong. Everything
//! here runs on a CPU; where libtorch sees a GPU, exercises 3 and 4 are also checked on it (the
//! output says "skipped: no CUDA device" otherwise).

#[path = "../lessons/11_gpus_nccl/exercise.rs"]
mod exercise_code;
#[path = "../solutions/11_gpus_nccl.rs"]
mod solution_code;

use shardlab::comm::auth::Secret;
use shardlab::comm::store::{StoreClient, StoreServer};
use shardlab::model::{Gpt, GptConfig, Model};
use shardlab::optim::{AdamW, AdamWConfig, Decay, Optimizer};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tch::{Device, Kind, Tensor};

shardlab::graders! {
    lesson: "11", exercise_file: "lessons/11_gpus_nccl/exercise.rs";

    /// shardlab's own copies of what each exercise builds (exercise K: `TWINS[K - 1]`): an exercise
    /// that names one is refused ("write it yourself").
    const TWINS: &[&[&str]] = &[&["flops::mfu", "flops::flops_per_token", "flops::matmul_params", "shardlab::flops"], &["nccl::share_unique_id", "comm::nccl", "nccl::UniqueId"], &["staging::stage", "comm::staging", "staging::output_buffer", "grading::"], &["staging::unstage", "comm::staging", "grading::"], &[]];

    /// Parameters that multiply activations, counted from a built model's tensors: all of them
    /// but the position embedding (`wpe`); the tied output head is the token embedding's tensor.
    fn measured_matmul_params(cfg: GptConfig) -> f64 {
        let m = Gpt::new(cfg, 0).unwrap();
        m.named_parameters().iter().filter(|(n, _)| !n.contains("wpe")).map(|(_, t)| t.numel() as f64).sum()
    }

    fn near(got: f64, want: f64) -> bool {
        (got - want).abs() <= 1e-9 * want.abs().max(1e-30)
    }

    #[test]
    fn ex1_mfu_counts_the_model_flops_of_a_training_step() {
        shardlab::grading::refuse_twins(GRADER, 1, TWINS[0]);
        // GPT-2 small (124M): N = 123,653,376 without wpe (nanoGPT's get_num_params() prints
        // "123.65M"), flops/token = 6N + 12·12·768·1024 = 741,920,256 + 113,246,208 = 855,166,464.
        // At 1,000,000 tokens/s on 8 GPUs of 989 TFLOP/s: 8.55166464e14 / 7.912e15 = 0.1080847...
        let gpt2 = GptConfig { vocab_size: 50257, block_size: 1024, n_layer: 12, n_head: 12, n_embd: 768 };
        let got = mfu(&gpt2, 1.0e6, 8, 989.0);
        assert!(
            near(got, 855_166_464.0e6 / (8.0 * 989.0e12)),
            "GPT-2 124M at 1M tokens/s on 8 × 989 TFLOP/s: MFU {got}, want 0.10808 (6N + 12·L·C·T = 855,166,464 FLOPs per \
             token, N = 123,653,376 parameters besides wpe)"
        );
        // Shapes where the terms weigh differently; N counted from the model's own tensors.
        for cfg in [
            GptConfig::tiny(),
            GptConfig { vocab_size: 97, block_size: 300, n_layer: 3, n_head: 2, n_embd: 48 },
            GptConfig { vocab_size: 4096, block_size: 8, n_layer: 1, n_head: 4, n_embd: 64 },
        ] {
            let n = measured_matmul_params(cfg);
            let (l, c, t) = (cfg.n_layer as f64, cfg.n_embd as f64, cfg.block_size as f64);
            let per_token = 6.0 * n + 12.0 * l * c * t;
            let (tps, devices, peak) = (12_345.0, 3, 0.5);
            let got = mfu(&cfg, tps, devices, peak);
            let want = tps * per_token / (devices as f64 * peak * 1e12);
            assert!(
                near(got, want),
                "{cfg:?}: MFU {got}, want {want}: the model has {n} parameters besides wpe (count wte once, every \
                 LayerNorm and bias too), 6 FLOPs each per token, plus 12·L·C·T = {} for attention",
                12.0 * l * c * t
            );
            let half = mfu(&cfg, tps, 2 * devices, peak);
            assert!(near(half, want / 2.0), "{cfg:?}: twice the devices at the same tokens/s is half the MFU");
        }
    }

    /// A store for a job, and a connect function for its ranks.
    fn store() -> (StoreServer, impl Fn() -> StoreClient + Clone) {
        let secret = Secret::derived_from_job_id("lesson11");
        let server = StoreServer::bind("127.0.0.1:0".parse().unwrap(), "lesson11", &secret).unwrap();
        let addr = server.addr().to_string();
        (server, move || StoreClient::connect(&addr, "lesson11", &secret, Duration::from_secs(10)).unwrap())
    }

    fn id_of(seed: u8) -> [u8; 128] {
        std::array::from_fn(|i| seed.wrapping_mul(31).wrapping_add((i as u8).wrapping_mul(7)))
    }

    /// Run `share_unique_id` on ranks `ranks` (threads), rank 0's `make_id` from `make`; each
    /// rank's result and how long it took.
    fn share(
        connect: impl Fn() -> StoreClient + Clone + Send + 'static,
        ranks: Vec<usize>,
        key: &'static str,
        make: Arc<dyn Fn() -> Result<[u8; 128], String> + Send + Sync>,
        timeout: Duration,
    ) -> Vec<(usize, Result<[u8; 128], String>, Duration)> {
        let handles: Vec<_> = ranks
            .into_iter()
            .map(|rank| {
                let (connect, make) = (connect.clone(), make.clone());
                std::thread::spawn(move || {
                    let mut c = connect();
                    if rank != 0 {
                        std::thread::sleep(Duration::from_millis(20)); // usually before rank 0 ...
                    } else {
                        std::thread::sleep(Duration::from_millis(60)); // ... has published
                    }
                    let t0 = Instant::now();
                    let r = share_unique_id(&mut c, rank, key, || make(), timeout);
                    (rank, r, t0.elapsed())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("share_unique_id panicked")).collect()
    }

    #[test]
    fn ex2_every_rank_gets_rank_0s_id_or_its_error_at_once() {
        shardlab::grading::refuse_twins(GRADER, 2, TWINS[1]);
        let (_server, connect) = store();
        let calls = Arc::new(AtomicUsize::new(0));
        let counted = {
            let calls = calls.clone();
            Arc::new(move || {
                calls.fetch_add(1, Ordering::SeqCst);
                Ok(id_of(5))
            })
        };
        for (rank, r, _) in share(connect.clone(), (0..4).collect(), "nccl/id/0", counted, Duration::from_secs(10)) {
            assert_eq!(r, Ok(id_of(5)), "rank {rank} of 4: every rank must return rank 0's id");
        }
        assert_eq!(calls.load(Ordering::SeqCst), 1, "make_id is rank 0's job: called once in all, by rank 0");
        // A second communicator (a subgroup, a restarted generation) under its own key: its own id.
        let other = Arc::new(|| Ok(id_of(9)));
        for (rank, r, _) in share(connect.clone(), vec![2, 0, 1], "nccl/id/1", other, Duration::from_secs(10)) {
            assert_eq!(r, Ok(id_of(9)), "rank {rank}: a second key is a second communicator with its own id");
        }
        // An id whose first bytes look like anything (here "error:") is still an id.
        let tricky: [u8; 128] = std::array::from_fn(|i| b"error:x"[i % 7]);
        let t = Arc::new(move || Ok(tricky));
        for (rank, r, _) in share(connect.clone(), vec![0, 1], "nccl/id/2", t, Duration::from_secs(10)) {
            assert_eq!(r, Ok(tricky), "rank {rank}: an id is any 128 bytes, whatever they look like");
        }
        // Rank 0 cannot make an id: every rank fails with its reason, long before the timeout.
        let failing = Arc::new(|| Err("no CUDA device (pretend)".to_string()));
        for (rank, r, took) in share(connect.clone(), (0..3).collect(), "nccl/id/3", failing, Duration::from_secs(8)) {
            let e = r.expect_err(&format!("rank {rank}: rank 0's make_id failed, so must this rank"));
            assert!(took < Duration::from_secs(4), "rank {rank} waited {took:?}: rank 0 must publish its failure ({e})");
            assert!(e.contains("no CUDA device (pretend)"), "rank {rank}: the error must carry rank 0's reason: {e}");
        }
        // Rank 0 never comes: the others give up after the timeout, saying so.
        let never = Arc::new(|| Ok(id_of(1)));
        for (rank, r, took) in share(connect.clone(), vec![1, 2], "nccl/id/4", never, Duration::from_millis(400)) {
            let e = r.expect_err(&format!("rank {rank}: nothing was published: an error, not an id"));
            assert!(e.contains("rank 0"), "rank {rank}: say that rank 0 published nothing: {e}");
            assert!(took >= Duration::from_millis(350), "rank {rank} gave up after {took:?}, before the timeout");
        }
        // Something else under the key: an error, not a panic and not a wrong id.
        let no_prefix = [b'x'; 131]; // 131 bytes: right length after stripping 3, but no `id:`
        for junk in [&b"id:short"[..], &[7u8; 128][..], &b""[..], &no_prefix[..]] {
            let mut c = connect();
            c.set("nccl/id/5", junk).unwrap();
            let r = share_unique_id(&mut c, 1, "nccl/id/5", || Ok(id_of(2)), Duration::from_secs(2));
            assert!(r.is_err(), "{:?}: not `id:` and exactly 128 bytes, so not an NCCL id: must be an error", String::from_utf8_lossy(junk));
        }
    }

    /// The GPU for the GPU half of a test, if libtorch sees one (SHARDLAB_EXPECT_GPU=1: it must).
    fn cuda() -> Option<Device> {
        if tch::Cuda::is_available() {
            Some(Device::Cuda(0))
        } else {
            assert!(std::env::var_os("SHARDLAB_EXPECT_GPU").is_none(), "SHARDLAB_EXPECT_GPU is set, but libtorch sees no GPU");
            eprintln!("lesson 11: skipped the GPU half: no CUDA device");
            None
        }
    }

    fn values(t: &Tensor) -> Vec<f64> {
        Vec::<f64>::try_from(t.to_device(Device::Cpu).to_kind(Kind::Double).reshape([-1])).unwrap()
    }

    #[test]
    fn ex3_stage_copies_only_what_must_move_or_be_made_contiguous() {
        shardlab::grading::refuse_twins(GRADER, 3, TWINS[2]);
        shardlab::device::load_libtorch_cuda(); // test binaries do not link it
        let t = Tensor::arange(12, (Kind::Float, Device::Cpu)).reshape([3, 4]);
        let s = stage(&t, Device::Cpu);
        let memory = |s: &Tensor| match shardlab::grading::memory(s) {
            Some(m) => format!("{:?} {:?} at {:#x}, strides {:?}", m.size, m.kind, m.address, m.stride),
            None => "an undefined tensor".to_string(),
        };
        assert!(
            shardlab::grading::same_memory(&s, &t),
            "a contiguous CPU tensor for a CPU backend: no copy, the tensor itself (its memory, shape and strides); got {}, \
             want {}",
            memory(&s),
            memory(&t)
        );
        let row = t.narrow(0, 1, 1); // contiguous, starting 4 elements in
        let s = stage(&row, Device::Cpu);
        assert!(shardlab::grading::same_memory(&s, &row), "a contiguous view is used in place too; got {}, want {}", memory(&s), memory(&row));
        for (what, v) in [("a transposed view", t.tr()), ("a strided column", t.narrow(1, 2, 1)), ("an expanded row", t.narrow(0, 0, 1).expand([5, 4], false))] {
            let s = stage(&v, Device::Cpu);
            assert!(s.is_contiguous(), "{what}: the backend needs contiguous memory");
            assert_eq!((s.size(), s.kind()), (v.size(), v.kind()), "{what}: same shape and kind");
            assert_eq!(values(&s), values(&v), "{what}: same values");
        }
        for kind in [Kind::BFloat16, Kind::Int64, Kind::Half] {
            let v = Tensor::arange(6, (kind, Device::Cpu)).reshape([2, 3]).tr();
            let s = stage(&v, Device::Cpu);
            assert_eq!(s.kind(), kind, "{kind:?}: staging keeps the kind");
            assert!(s.is_contiguous(), "{kind:?}, a transposed view: the backend needs contiguous memory");
            shardlab::grading::assert_layout(&s, &[3, 2], kind, &format!("{kind:?}, a transposed [3, 2] view, staged"));
            assert_eq!(values(&s), values(&v), "{kind:?}: same values");
        }
        if let Some(gpu) = cuda() {
            let g = t.to_device(gpu);
            let h = stage(&g, Device::Cpu);
            assert_eq!(h.device(), Device::Cpu, "GPU → CPU backend: a host copy");
            shardlab::grading::assert_layout(&h, &[3, 4], Kind::Float, "GPU → CPU: the host copy");
            assert!(h.is_contiguous(), "GPU → CPU: the backend needs contiguous memory");
            assert!(h.is_pinned(gpu), "from a GPU, stage into pinned (page-locked) host memory");
            assert_eq!(values(&h), values(&t), "GPU → CPU: the same values");
            let back = stage(&t.tr(), gpu);
            assert!(back.device() == gpu && back.is_contiguous(), "CPU → NCCL: a contiguous device copy");
            shardlab::grading::assert_layout(&back, &[4, 3], Kind::Float, "CPU → GPU: a transposed [4, 3] view, staged");
            assert_eq!(values(&back), values(&t.tr()), "CPU → GPU: the same values");
            let s = stage(&g, gpu);
            assert!(
                shardlab::grading::same_memory(&s, &g),
                "on the GPU for a GPU backend: no copy, the tensor itself; got {}, want {}",
                memory(&s),
                memory(&g)
            );
        }
    }

    #[test]
    fn ex4_unstage_writes_into_the_callers_memory() {
        shardlab::grading::refuse_twins(GRADER, 4, TWINS[3]);
        shardlab::device::load_libtorch_cuda(); // test binaries do not link it
        // The caller's tensor is a transposed view of a buffer the model reads.
        let base = Tensor::zeros([2, 3], (Kind::Float, Device::Cpu));
        let mut view = base.tr();
        let view_memory = shardlab::grading::memory(&view);
        let staged = Tensor::arange(6, (Kind::Float, Device::Cpu)).reshape([3, 2]);
        unstage(&mut view, &staged);
        assert_eq!(values(&base.tr()), values(&staged), "the result must land in the buffer behind the view");
        assert!(
            shardlab::grading::memory(&view) == view_memory,
            "write into dst's memory; do not make dst a new tensor (or another view)"
        );
        // Already the caller's memory (a contiguous tensor staged in place): unchanged.
        let mut t = Tensor::from_slice(&[1.0f32, 2.0, 3.0]);
        let same = t.shallow_clone();
        let t_memory = shardlab::grading::memory(&t);
        unstage(&mut t, &same);
        assert!(shardlab::grading::memory(&t) == t_memory, "staged is dst's own memory: leave dst as it is");
        assert_eq!(values(&t), vec![1.0, 2.0, 3.0], "staged is dst's own memory: leave it as it is");
        // Already dst's memory, and autograd saved dst for a backward (exp keeps its output): a copy
        // onto itself changes no value, but it is a write — a kernel on a GPU, and autograd then
        // refuses the backward that needs the saved tensor ("modified by an inplace operation").
        let a = Tensor::from_slice(&[0.5f32, 1.0, 1.5]).set_requires_grad(true);
        let mut d = a.exp();
        let own = d.detach();
        unstage(&mut d, &own);
        let backward = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| d.sum(Kind::Float).backward()));
        assert!(
            backward.is_ok(),
            "staged was dst's own memory (same device, address, shape and strides), yet unstage wrote into it: \
             autograd then refused a backward through dst. Do nothing when there is nothing to copy"
        );
        // A bf16 caller staged as bf16; a column of a matrix.
        let m = Tensor::zeros([3, 3], (Kind::BFloat16, Device::Cpu));
        let mut col = m.narrow(1, 1, 1);
        unstage(&mut col, &Tensor::ones([3, 1], (Kind::BFloat16, Device::Cpu)));
        assert_eq!(values(&m.sum_dim_intlist([0].as_slice(), false, Kind::Float)), vec![0.0, 3.0, 0.0], "only the column");
        // A parameter (a leaf that requires grad), as when broadcast weights come back: the copy is
        // not part of the model's computation, so autograd must not record it (libtorch refuses an
        // in-place write to such a leaf while it records).
        let mut p = Tensor::zeros([3], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let p_memory = shardlab::grading::memory(&p);
        let back = Tensor::from_slice(&[1.0f32, 2.0, 3.0]);
        let wrote = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| unstage(&mut p, &back)));
        assert!(
            wrote.is_ok(),
            "unstage into a parameter (a leaf that requires grad) failed: the copy back must not be recorded by \
             autograd (`cargo grade 11 --hint 4`)"
        );
        assert_eq!(values(&p.detach()), vec![1.0, 2.0, 3.0], "the parameter must hold the result");
        assert!(p.requires_grad() && p.is_leaf(), "the parameter must stay a leaf that requires grad");
        assert!(shardlab::grading::memory(&p) == p_memory, "write into the parameter's own memory (the model holds it); do not replace it");
        if let Some(gpu) = cuda() {
            let g = Tensor::zeros([4], (Kind::Float, gpu));
            let mut gv = g.shallow_clone();
            unstage(&mut gv, &Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0]));
            assert_eq!(values(&g), vec![1.0, 2.0, 3.0, 4.0], "a host result back into a GPU tensor");
        }
    }

    fn opt_cfg() -> AdamWConfig {
        AdamWConfig { lr: 1e-2, ..AdamWConfig::default() }
    }

    #[test]
    fn ex5_offloaded_step_is_adamw_on_the_f32_masters() {
        // Three slots: a bf16 matrix (decayed), a bf16 bias, an f32 vector; gradients in bf16, bf16, f32.
        tch::manual_seed(11);
        let shapes: [(&[i64], Kind, Kind); 3] =
            [(&[8, 5], Kind::BFloat16, Kind::BFloat16), (&[5], Kind::BFloat16, Kind::BFloat16), (&[7], Kind::Float, Kind::Float)];
        let masters: Vec<Tensor> = shapes.iter().map(|(s, _, _)| Tensor::randn(*s, (Kind::Float, Device::Cpu)).reshape([-1])).collect();
        let params: Vec<Tensor> = masters.iter().zip(&shapes).map(|(m, (s, k, _))| m.to_kind(*k).reshape(*s)).collect();
        let grad_hosts: Vec<Tensor> = masters.iter().map(|m| Tensor::zeros_like(m)).collect();
        let decay = || vec![Decay::All, Decay::Nothing, Decay::Nothing];
        // The reference: libtorch-free bookkeeping, shardlab's AdamW on f32 copies.
        let ref_masters: Vec<Tensor> = masters.iter().map(|m| m.copy()).collect();
        let (mut opt, mut ref_opt) = (AdamW::new(opt_cfg()), AdamW::new(opt_cfg()));
        let ptrs = |v: &[Tensor]| v.iter().map(|t| t.data_ptr() as usize).collect::<Vec<_>>();
        let (p0, m0, h0) = (ptrs(&params), ptrs(&masters), ptrs(&grad_hosts));
        for step in 0..4 {
            let grads: Vec<Tensor> =
                shapes.iter().map(|(s, _, gk)| (Tensor::randn(*s, (Kind::Float, Device::Cpu)) * 0.1).to_kind(*gk)).collect();
            let (down, up) = offload_step(&mut opt, 1e-2, &params, &grads, &masters, &grad_hosts, &decay())
                .unwrap_or_else(|e| panic!("step {step}: {e}"));
            let g32: Vec<Tensor> = grads.iter().map(|g| g.to_kind(Kind::Float).reshape([-1])).collect();
            ref_opt.step(1e-2, &ref_masters, &g32, &decay()).unwrap();
            for i in 0..3 {
                assert_eq!(values(&grad_hosts[i]), values(&g32[i]), "step {step} slot {i}: grad_hosts must hold the gradient in f32");
                assert_eq!(
                    values(&masters[i]),
                    values(&ref_masters[i]),
                    "step {step} slot {i}: the masters must be exactly AdamW's f32 step on the gradients (step the masters, \
                     not the {:?} parameters)",
                    shapes[i].1
                );
                let want = ref_masters[i].to_kind(shapes[i].1).reshape(shapes[i].0);
                assert_eq!(params[i].kind(), shapes[i].1, "step {step} slot {i}: the parameter keeps its kind");
                assert_eq!(values(&params[i]), values(&want), "step {step} slot {i}: the parameter must be its master, cast to {:?}", shapes[i].1);
            }
            // bf16 gradients and parameters cross in 2 bytes, f32 in 4: 40·2 + 5·2 + 7·4 each way.
            assert_eq!(
                (down, up),
                (118, 118),
                "step {step}: bytes copied (down, up) = 40·2 + 5·2 + 7·4 each way: each tensor crosses in its own kind \
                 (count them even on a CPU)"
            );
        }
        assert_eq!(ptrs(&params), p0, "write into the parameters' memory (the model reads it), do not replace it");
        assert_eq!(ptrs(&masters), m0, "the masters are stepped in place");
        assert_eq!(ptrs(&grad_hosts), h0, "the host gradient buffers are reused, not replaced");
        // The optimizer refuses a slot list that changed (two slots after three): that is the
        // error, and no parameter changes.
        let before = values(&params[0]);
        let grads: Vec<Tensor> = params[..2].iter().map(|p| p.zeros_like()).collect();
        let r = offload_step(&mut opt, 1e-2, &params[..2], &grads, &masters[..2], &grad_hosts[..2], &decay()[..2]);
        assert!(r.is_err(), "the optimizer refused the step (its slots changed): return its error, got {r:?}");
        assert_eq!(values(&params[0]), before, "a refused step changes no parameter");
    }
}
