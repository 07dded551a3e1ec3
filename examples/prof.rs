use shardlab::model::zero_grads;
use shardlab::prelude::*;
use std::time::Instant;
fn main() {
    tch::set_num_threads(1);
    let cfg = GptConfig::bench();
    let m = Gpt::new(cfg, 0).unwrap();
    let mut opt = AdamWConfig::default().build(&m).unwrap();
    let mut r = shardlab::rng::Rng::new(1);
    let data = Tokens((0..200000).map(|_| r.below(4096) as u16).collect());
    let s = DistributedSampler::new(128, 8, 0, 1, 0).unwrap();
    let (mut f, mut b, mut o) = (0.0, 0.0, 0.0);
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
    println!("fwd {:.1} ms bwd {:.1} ms opt {:.1} ms", f * 100.0, b * 100.0, o * 100.0);
}
