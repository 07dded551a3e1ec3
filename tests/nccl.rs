//! The nccl backend (lesson 11). On a machine with a CUDA device: NCCL at world size 1 (one GPU
//! here; NCCL refuses two ranks on one GPU) runs every collective on device memory and agrees
//! with the arithmetic, and a CPU tensor is staged through the GPU. Without one: every way in says
//! why it cannot run, and the test says it skipped the device half.

use shardlab::device::cuda_devices;
use shardlab::prelude::*;

const NAME: &str = "nccl_collectives_at_world_size_one";

#[test]
fn nccl_collectives_at_world_size_one() {
    shardlab::device::load_libtorch_cuda();
    let opts = SpawnOptions::new(1, Backend::Nccl).child_args(vec![
        "--exact".into(),
        NAME.into(),
        "--nocapture".into(),
        "--test-threads=1".into(),
    ]);
    if cuda_devices() == 0 {
        // On the device check (`.ci/gpu`) a skip would be a silent pass: fail instead.
        assert!(
            std::env::var_os("SHARDLAB_EXPECT_GPU").is_none(),
            "SHARDLAB_EXPECT_GPU is set, but libtorch sees no GPU"
        );
        let e = spawn_with(opts, |_pg| Ok(())).unwrap_err().to_string();
        assert!(e.contains("needs a CUDA device"), "{e}");
        let t = spawn_with(SpawnOptions::new(1, Backend::Nccl).launch(Launch::Threads), |_pg| Ok(()));
        assert!(t.unwrap_err().to_string().contains("processes"));
        eprintln!("skipped: no CUDA device (checked the errors without one)");
        return;
    }
    let out = spawn_with(opts, |pg| {
        let dev = Device::Cuda(0);
        let mut t = Tensor::arange(8, (Kind::Float, dev));
        pg.all_reduce(&mut t, ReduceOp::Sum)?;
        let mut g = Tensor::zeros([8], (Kind::Float, dev));
        pg.all_gather(&mut g, &Tensor::arange(8, (Kind::Float, dev)))?;
        let mut r = Tensor::zeros([8], (Kind::BFloat16, dev));
        pg.reduce_scatter(&mut r, &Tensor::ones([8], (Kind::BFloat16, dev)), ReduceOp::Sum)?;
        let mut b = Tensor::full([3], 7.0, (Kind::Double, dev));
        pg.broadcast(&mut b, 0)?;
        let w = pg.all_reduce_async(Tensor::ones([4], (Kind::Float, dev)), ReduceOp::Avg)?.wait()?;
        let mut cpu = Tensor::from_slice(&[2.5f64]); // a loss on the CPU: staged through the GPU
        pg.all_reduce(&mut cpu, ReduceOp::Sum)?;
        pg.barrier()?;
        let f = |t: &Tensor| Vec::<f64>::try_from(&t.to_device(Device::Cpu).to_kind(Kind::Double)).unwrap();
        Ok((f(&t), f(&g), f(&r), f(&b), f(&w), f(&cpu), pg.data_path().to_string()))
    })
    .unwrap();
    let (t, g, r, b, w, cpu, path) = &out[0];
    let ar: Vec<f64> = (0..8).map(f64::from).collect();
    assert_eq!(t, &ar, "all_reduce over one rank is the identity");
    assert_eq!(g, &ar, "all_gather over one rank copies the input");
    assert_eq!(r, &vec![1.0; 8]);
    assert_eq!(b, &vec![7.0; 3]);
    assert_eq!(w, &vec![1.0; 4]);
    assert_eq!(cpu, &vec![2.5]);
    assert_eq!(path, "nccl");
}

/// The unique id's hand-over (`nccl::share_unique_id`, what `init_nccl` uses): every rank gets rank
/// 0's id; when rank 0 cannot make one, every rank fails at once with its reason (no GPU needed).
#[test]
fn the_unique_id_reaches_every_rank_and_so_does_rank_0s_failure() {
    use shardlab::comm::auth::Secret;
    use shardlab::comm::nccl::{share_unique_id, UniqueId};
    use shardlab::comm::store::{StoreClient, StoreServer};
    use std::time::{Duration, Instant};
    let secret = Secret::generate().unwrap();
    let server = StoreServer::bind("127.0.0.1:0".parse().unwrap(), "nccl-id", &secret).unwrap();
    let addr = server.addr().to_string();
    let run = |key: &'static str, fail: bool| -> Vec<(Result<[u8; 128], String>, Duration)> {
        std::thread::scope(|s| {
            let hs: Vec<_> = (0..3)
                .map(|rank| {
                    let (addr, secret) = (addr.clone(), &secret);
                    s.spawn(move || {
                        let mut c = StoreClient::connect(&addr, "nccl-id", secret, Duration::from_secs(5)).unwrap();
                        let t0 = Instant::now();
                        let make = || {
                            if fail {
                                Err(CommError::Io("no GPU (pretend)".into()))
                            } else {
                                Ok(UniqueId([7; 128]))
                            }
                        };
                        let r = share_unique_id(&mut c, rank, key, make, Duration::from_secs(20));
                        (r.map(|id| id.0).map_err(|e| e.to_string()), t0.elapsed())
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    };
    for (r, _) in run("nccl/id/a", false) {
        assert_eq!(r, Ok([7; 128]));
    }
    for (r, took) in run("nccl/id/b", true) {
        let e = r.unwrap_err();
        assert!(e.contains("no GPU (pretend)") && took < Duration::from_secs(5), "{e} after {took:?}");
    }
}
