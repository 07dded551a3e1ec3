//! The FSDP round trip of a stack of units, with its memory made countable.
//!
//! [`Zero`](super::Zero) drives the round trip of a real model by itself. Lesson 06's exercise 4
//! has the learner drive it: for each unit, all-gather its parameters before its forward
//! (prefetching the next unit's gather), free them after, gather them again in backward in reverse
//! order, and reduce-scatter its gradient. The model side of that loop is a [`UnitStack`]: it
//! computes a unit's forward or backward given the unit's full flat parameters, and it hands out
//! the buffers those parameters are gathered into, as [`Gathered`] handles.
//!
//! A [`Gathered`] counts as a gathered unit from the moment it is handed out (its buffer is
//! allocated then, before the all-gather fills it) until it is dropped. [`LiveUnits`] keeps that
//! count, so whoever implements the stack can see how many full units a rank held at once: FSDP's
//! point is that this stays at two (the unit computing and the one prefetched), however many
//! units the model has.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use tch::{Kind, Tensor};

#[derive(Debug, Default)]
struct Live {
    /// The unit of every buffer alive now (a unit twice if two of its buffers are alive), and
    /// whether its memory has been handed to a collective ([`Gathered::out`]).
    units: Vec<(usize, Rc<Cell<bool>>)>,
    peak: usize,
    allocated: usize,
}

/// Counts the [`Gathered`] buffers of one rank that are alive at once. Cloning it gives another
/// handle to the same count.
#[derive(Clone, Debug, Default)]
pub struct LiveUnits(Rc<RefCell<Live>>);

impl LiveUnits {
    /// A new count, at zero.
    pub fn new() -> Self {
        Self::default()
    }

    /// A zeroed f32 buffer of `numel` elements for unit `unit`'s full flat parameters, counted as
    /// alive until the returned handle is dropped.
    pub fn alloc(&self, unit: usize, numel: i64) -> Gathered {
        let mut l = self.0.borrow_mut();
        let started = Rc::new(Cell::new(false));
        l.units.push((unit, started.clone()));
        l.allocated += 1;
        l.peak = l.peak.max(l.units.len());
        Gathered { unit, full: Tensor::zeros([numel], (Kind::Float, tch::Device::Cpu)), live: self.clone(), started }
    }

    /// The units whose buffers are alive now, sorted (a unit appears once per live buffer).
    pub fn live(&self) -> Vec<usize> {
        let mut v: Vec<usize> = self.0.borrow().units.iter().map(|u| u.0).collect();
        v.sort_unstable();
        v
    }

    /// The live units whose buffer has been handed to a collective ([`Gathered::out`]): their
    /// gather has at least been started.
    pub fn started(&self) -> Vec<usize> {
        let mut v: Vec<usize> = self.0.borrow().units.iter().filter(|u| u.1.get()).map(|u| u.0).collect();
        v.sort_unstable();
        v
    }

    /// The most buffers alive at once so far.
    pub fn peak(&self) -> usize {
        self.0.borrow().peak
    }

    /// How many buffers were handed out so far.
    pub fn allocated(&self) -> usize {
        self.0.borrow().allocated
    }
}

/// The full flat parameters of one unit on this rank: a buffer that an all-gather fills, counted
/// by its [`LiveUnits`] from its allocation until it is dropped. Dropping it is how a unit is
/// released.
#[derive(Debug)]
pub struct Gathered {
    unit: usize,
    full: Tensor,
    live: LiveUnits,
    started: Rc<Cell<bool>>,
}

impl Gathered {
    /// Which unit's parameters this buffer is for.
    pub fn unit(&self) -> usize {
        self.unit
    }

    /// A handle to the buffer, to pass as the output of a collective (`pg.all_gather_async(g.out(),
    /// …)`): the collective writes into this `Gathered`'s memory. Do not read the parameters
    /// before the collective's `Work` has been waited on.
    pub fn out(&self) -> Tensor {
        self.started.set(true);
        self.full.shallow_clone()
    }

    /// The unit's full flat parameters (what the all-gather wrote).
    pub fn params(&self) -> &Tensor {
        &self.full
    }
}

impl Drop for Gathered {
    fn drop(&mut self) {
        let mut l = self.live.0.borrow_mut();
        if let Some(i) = l.units.iter().position(|u| Rc::ptr_eq(&u.1, &self.started)) {
            l.units.swap_remove(i);
        }
    }
}

/// A model cut into units, as the FSDP round trip drives it: each unit's forward and backward
/// given its full flat parameters (padded to a multiple of the world size, rank 0's shard first).
///
/// Call order: `forward` of units 0, 1, …, `num_units() − 1`, then `backward` of the same units
/// in reverse. `backward(i)` returns unit i's full flat gradient (same length as its parameters)
/// for this rank's batch; the stack carries the activations and the gradient flowing between
/// units itself.
pub trait UnitStack {
    /// How many units.
    fn num_units(&self) -> usize;
    /// A fresh buffer for unit `unit`'s full flat parameters, counted as a gathered unit until it
    /// is dropped.
    fn buffer(&self, unit: usize) -> Gathered;
    /// Forward of unit `unit` on its gathered parameters.
    fn forward(&self, unit: usize, params: &Gathered);
    /// Backward of unit `unit` on its gathered parameters: its full flat gradient.
    fn backward(&self, unit: usize, params: &Gathered) -> Tensor;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_buffers_from_allocation_to_drop() {
        let live = LiveUnits::new();
        let a = live.alloc(0, 4);
        let b = live.alloc(1, 6);
        assert_eq!((live.live(), live.peak()), (vec![0, 1], 2));
        assert!(live.started().is_empty(), "nothing handed to a collective yet");
        assert_eq!(b.params().numel(), 6);
        let _ = b.out().fill_(3.0);
        assert_eq!(b.params().double_value(&[5]), 3.0, "out() writes into the buffer");
        assert_eq!(live.started(), vec![1]);
        drop(a);
        let c = live.alloc(1, 6);
        assert_eq!((live.live(), live.peak(), live.allocated()), (vec![1, 1], 2, 3));
        drop((b, c));
        assert!(live.live().is_empty());
    }
}
