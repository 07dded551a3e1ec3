//! Helpers on lists of parameter tensors that every parallel strategy needs: make all ranks start
//! from the same weights (broadcast from a root) and check that they really hold the same bytes.

use crate::comm::{CommResult, ProcessGroup};
use tch::{Kind, Tensor};

/// 64-bit FNV-1a over the raw bytes of every tensor, in order: equal on two ranks iff (with
/// overwhelming probability) they hold bit-identical parameters. Works on any CPU tensors.
pub fn checksum(params: &[Tensor]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for p in params {
        let c = p.contiguous();
        let bytes = c.numel() * c.kind().elt_size_in_bytes();
        let data = unsafe { std::slice::from_raw_parts(c.data_ptr() as *const u8, bytes) };
        for &b in data {
            h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

/// Copy `root`'s parameters into every rank's, in place (what DDP does at construction).
pub fn broadcast_params(pg: &ProcessGroup, params: &mut [Tensor], root: usize) -> CommResult<()> {
    params.iter_mut().try_for_each(|p| pg.broadcast(p, root))
}

/// A stand-in model for the early lessons: tensors of the given sizes, initialised from `seed`
/// (so different seeds on different ranks give different weights, as unsynchronised ranks would).
pub fn random_params(sizes: &[i64], seed: i64) -> Vec<Tensor> {
    tch::manual_seed(seed);
    sizes.iter().map(|&n| Tensor::randn([n], (Kind::Float, tch::Device::Cpu))).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checksum_sees_one_flipped_bit() {
        let a = random_params(&[10, 3], 1);
        let b: Vec<Tensor> = a.iter().map(|t| t.copy()).collect();
        assert_eq!(checksum(&a), checksum(&b));
        let _ = b[1].get(2).fill_(a[1].double_value(&[2]) + 1e-6);
        assert_ne!(checksum(&a), checksum(&b));
    }
}
