//! Which parameters each pipeline rank holds ([`params_of_ranks`]): those of its stages. The tied
//! embedding lives on the first and the last rank, gets the same summed gradient on both (the
//! executor sums them) and so stays the same.
//!
//! A pipeline rank's optimizer step is the engine's (`crate::engine`: the rank's stages are a
//! `PipelinePiece`, stepped with every other layout's one step).

use super::partition;
use crate::model::{Gpt, GptConfig};

/// Which parameters (by index in the GPT's `named_parameters`) each of `p` pipeline ranks uses:
/// those of its stages, the tied embedding on the first and the last rank.
pub fn params_of_ranks(cfg: &GptConfig, p: usize) -> Result<Vec<Vec<usize>>, String> {
    let uses = Gpt::stage_uses_of(cfg);
    let parts = partition(uses.len(), p)?;
    Ok(parts
        .into_iter()
        .map(|r| {
            let mut v: Vec<usize> = r.flat_map(|s| uses[s].iter().copied()).collect();
            v.sort_unstable();
            v.dedup();
            v
        })
        .collect())
}
