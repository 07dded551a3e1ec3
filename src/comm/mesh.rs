//! A device mesh (lesson 12), like PyTorch's `init_device_mesh`: the ranks of a group laid out as
//! an n-dimensional array with named dimensions, e.g. 2 × 2 = `["dp", "tp"]`, row-major (the last
//! dimension varies fastest: ranks 0 and 1 share a `dp` coordinate and form a `tp` group). Each
//! dimension gives every rank one subgroup: the ranks that differ from it only along that
//! dimension (a row or a column of the 2-D case), made with [`ProcessGroup::split`].
//!
//! ```text
//!            tp=0  tp=1
//!   dp=0  [ rank 0, rank 1 ]   tp groups: {0,1}, {2,3}   (rows)
//!   dp=1  [ rank 2, rank 3 ]   dp groups: {0,2}, {1,3}   (columns)
//! ```

use super::error::{CommError, CommResult};
use super::group::ProcessGroup;
use tch::Tensor;

/// This rank's view of a mesh: its coordinates and, per dimension, its subgroup.
pub struct DeviceMesh {
    names: Vec<String>,
    shape: Vec<usize>,
    coords: Vec<usize>,
    groups: Vec<ProcessGroup>,
}

impl DeviceMesh {
    /// Lay out `pg`'s ranks as `shape` with dimension `names` (every rank calls it, with the same
    /// shape and names). The product of the shape must be the world size; a shape that differs
    /// between ranks is an error on every rank. Makes one subgroup per dimension.
    pub fn new(pg: &ProcessGroup, shape: &[usize], names: &[&str]) -> CommResult<DeviceMesh> {
        let rank = pg.rank();
        let bad = |m: String| CommError::InvalidArgument(format!("rank {rank}: device mesh {shape:?} {names:?}: {m}"));
        let size: usize = shape.iter().product();
        let local = if shape.is_empty() || shape.len() != names.len() {
            Some("one name per dimension, at least one dimension".to_string())
        } else if shape.iter().any(|&s| s == 0) {
            Some("every dimension needs at least one rank".into())
        } else if size != pg.world_size() {
            Some(format!("{size} ranks, but the group has {}", pg.world_size()))
        } else if names.iter().enumerate().any(|(i, n)| names[..i].contains(n)) {
            Some("dimension names must differ".into())
        } else {
            None
        };
        // Every rank must lay out the same, valid mesh: one all-reduce (max) of a digest of it,
        // its negation, and whether this rank found it invalid — joined by every rank even when
        // its own arguments are bad, so that every rank fails, none waits.
        let digest = shape
            .iter()
            .copied()
            .chain(names.iter().map(|n| n.len()))
            .fold(17i64, |h, x| h.wrapping_mul(31).wrapping_add(x as i64))
            .wrapping_add(
                names.iter().flat_map(|n| n.bytes()).fold(0i64, |h, b| h.wrapping_mul(131).wrapping_add(b as i64)),
            )
            & 0x3fff_ffff_ffff_ffff; // non-negative, so that -digest cannot overflow
        let mut mm = Tensor::from_slice(&[digest, -digest, local.is_some() as i64]);
        pg.all_reduce(&mut mm, super::ReduceOp::Max)?;
        let v = Vec::<i64>::try_from(&mm).map_err(|e| CommError::Protocol(e.to_string()))?;
        if let Some(m) = local {
            return Err(bad(m));
        }
        if v[2] != 0 {
            return Err(bad("another rank's mesh arguments are invalid".into()));
        }
        if v[0] != digest || -v[1] != digest {
            return Err(bad("the ranks disagree on the mesh (every rank must pass the same shape and names)".into()));
        }
        // Row-major coordinates.
        let mut coords = vec![0; shape.len()];
        let mut r = rank;
        for d in (0..shape.len()).rev() {
            coords[d] = r % shape[d];
            r /= shape[d];
        }
        let mut groups = Vec::new();
        for d in 0..shape.len() {
            // Color: this rank's coordinates with dimension d left out, as one number.
            let color = (0..shape.len()).filter(|&e| e != d).fold(0, |c, e| c * shape[e] + coords[e]);
            let g = pg.split(Some(color), coords[d])?.expect("every rank is in one group per dimension");
            groups.push(g);
        }
        Ok(DeviceMesh { names: names.iter().map(|s| s.to_string()).collect(), shape: shape.to_vec(), coords, groups })
    }

    fn dim(&self, name: &str) -> usize {
        self.names
            .iter()
            .position(|n| n == name)
            .unwrap_or_else(|| panic!("the mesh has no dimension {name:?} (it has {:?})", self.names))
    }
    /// This rank's subgroup along dimension `name`.
    pub fn group(&self, name: &str) -> &ProcessGroup {
        &self.groups[self.dim(name)]
    }
    /// This rank's coordinate along `name` (= its rank in [`group(name)`](Self::group)).
    pub fn coord(&self, name: &str) -> usize {
        self.coords[self.dim(name)]
    }
    /// The number of ranks along `name`.
    pub fn size(&self, name: &str) -> usize {
        self.shape[self.dim(name)]
    }
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    pub fn names(&self) -> &[String] {
        &self.names
    }
}
