use shardlab::model::zero_grads;
use shardlab::prelude::*;
use std::time::Instant;
fn main() {
    if let Ok(v) = std::env::var("MALLOPT") {
        let v: i32 = v.parse().unwrap();
        unsafe {
            let a = libc::mallopt(libc::M_MMAP_THRESHOLD, v);
            let b = libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
            eprintln!("mallopt {a} {b}");
        }
    }
    tch::set_num_threads(1);
    let cfg = GptConfig::bench();
    let m = Gpt::new(cfg, 0).unwrap();
    let mut opt = AdamWConfig::default().build(&m).unwrap();
    let mut r = shardlab::rng::Rng::new(1);
    let data = Tokens((0..200000).map(|_| r.below(4096) as u16).collect());
    let s = DistributedSampler::new(128, 8, 0, 1, 0).unwrap();
    let (mut f, mut b, mut o) = (0.0, 0.0, 0.0);
    let mut ru0: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru0) };
    println!("minflt before {}", ru0.ru_minflt);
    for step in 0..12 {
        let batch = s.batch(&data, step);
        let t0 = Instant::now();
        let loss = m.loss(&batch);
        let _ = loss.double_value(&[]);
        let t1 = Instant::now();
        loss.backward();
        let t2 = Instant::now();
        opt.step();
        opt.zero_grad();
        let t3 = Instant::now();
        if step >= 2 {
            f += (t1 - t0).as_secs_f64();
            b += (t2 - t1).as_secs_f64();
            o += (t3 - t2).as_secs_f64();
        }
    }
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    println!("minflt {}", ru.ru_minflt);
    println!("fwd {:.1} ms bwd {:.1} ms opt {:.1} ms", f * 100.0, b * 100.0, o * 100.0);
}
