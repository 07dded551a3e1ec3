//! The README's first listing: four ranks sum their rank numbers with one all-reduce.
//!
//! `cargo run --release --example all_reduce` (`tests/docs.rs` checks that the README and
//! `src/comm/mod.rs` show exactly the lines between the `listing` markers, and runs this).

fn main() -> anyhow::Result<()> {
    // listing: begin
    use shardlab::prelude::*;

    let sums = spawn(4, Backend::Tcp, |pg| {
        let mut t = Tensor::from_slice(&[pg.rank() as f32]);
        pg.all_reduce(&mut t, ReduceOp::Sum)?; // every rank: 0+1+2+3
        Ok(t.double_value(&[0]))
    })?;
    assert_eq!(sums, vec![6.0; 4]);
    // listing: end
    if !shardlab::launch::is_spawned_child() {
        println!("every rank holds {}", sums[0]);
    }
    Ok(())
}
