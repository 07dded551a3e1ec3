//! Tensor checks for graders: a tensor's shape and kind before its values. libtorch broadcasts,
//! so the right values in a `[1, n]` compared with an expected `[n]` would pass, and a `[n, 1]`
//! would broadcast to `[n, n]` and fail with a misleading difference; a shape that does not
//! broadcast at all would fail inside libtorch, with a message about the grader's code.

use tch::{Device, Kind, Tensor};

/// Why `got` is not a `shape` tensor of kind `kind`, or `None` when it is: its shape and kind
/// against the wanted ones, with the likely cause where one is recognisable.
pub fn layout_error(got: &Tensor, shape: &[i64], kind: Kind) -> Option<String> {
    if !got.defined() {
        return Some(format!("an undefined tensor (`Tensor::new()`?), want shape {shape:?} {kind:?}"));
    }
    let (s, k) = (got.size(), got.kind());
    if s == shape && k == kind {
        return None;
    }
    let why = if s != shape && got.numel() as i64 == shape.iter().product::<i64>() {
        " (the right number of elements in the wrong shape: a view or reshape too many, or too few?)"
    } else if s != shape {
        ""
    } else {
        " (a conversion too many, or one missing?)"
    };
    Some(format!("shape {s:?} {k:?}, want {shape:?} {kind:?}{why}"))
}

/// Panic, naming `what`, unless `got` has exactly the shape `shape` and the kind `kind`.
pub fn assert_layout(got: &Tensor, shape: &[i64], kind: Kind, what: &str) {
    if let Some(e) = layout_error(got, shape, kind) {
        panic!("{what}: {e}");
    }
}

/// [`assert_layout`] against `want`'s shape and kind, then the largest |got − want| (NaN counts
/// as infinite).
pub fn max_diff(got: &Tensor, want: &Tensor, what: &str) -> f64 {
    assert_layout(got, &want.size(), want.kind(), what);
    if got.numel() == 0 {
        return 0.0;
    }
    let d = (got.to_kind(Kind::Double) - want.to_kind(Kind::Double)).abs().max().double_value(&[]);
    if d.is_nan() {
        f64::INFINITY
    } else {
        d
    }
}

/// Where a tensor's elements are, as values taken at one moment: device, kind, address, shape and
/// strides (`None` for an undefined tensor). Two tensors with the same `Memory` are the same
/// elements seen the same way; a view of other elements, or of the same elements in another shape
/// or kind, differs.
#[derive(Debug, Clone, PartialEq)]
pub struct Memory {
    pub device: Device,
    pub kind: Kind,
    pub address: usize,
    pub size: Vec<i64>,
    pub stride: Vec<i64>,
}

/// `t`'s [`Memory`] now; later changes to `t` (a `set_data`, a `resize_`) do not change it.
pub fn memory(t: &Tensor) -> Option<Memory> {
    t.defined().then(|| Memory {
        device: t.device(),
        kind: t.kind(),
        address: t.data_ptr() as usize,
        size: t.size(),
        stride: t.stride(),
    })
}

/// Whether `a` is `b`'s memory as it stands (see [`Memory`]).
pub fn same_memory(a: &Tensor, b: &Tensor) -> bool {
    a.defined() && memory(a) == memory(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_broadcastable_shape_is_refused_before_any_value_is_compared() {
        let want = Tensor::from_slice(&[1.0f32, 2.0, 3.0]);
        let row = want.view([1, 3]);
        assert!(row.allclose(&want, 0.0, 0.0, false), "libtorch alone would let it pass");
        let e = std::panic::catch_unwind(|| max_diff(&row, &want, "y")).unwrap_err();
        let msg = crate::grading::payload_message(&*e);
        assert!(msg.contains("shape [1, 3] Float, want [3] Float") && msg.contains("wrong shape"), "{msg}");
        let e = std::panic::catch_unwind(|| max_diff(&want.to_kind(Kind::Double), &want, "y")).unwrap_err();
        assert!(crate::grading::payload_message(&*e).contains("conversion"));
        assert_eq!(max_diff(&(&want + 0.5), &want, "y"), 0.5);
        assert_eq!(max_diff(&(&want * f64::NAN), &want, "y"), f64::INFINITY);
        assert!(
            same_memory(&want, &want.shallow_clone()) && !same_memory(&want, &row) && !same_memory(&want, &want.copy())
        );
        let ints = Tensor::from_slice(&[1i32, 2, 3]);
        assert!(!same_memory(&ints, &ints.view_dtype(Kind::Float)), "another kind over the same bytes is not the same");
        assert!(layout_error(&want, &[3], Kind::Float).is_none());
        assert!(layout_error(&Tensor::new(), &[3], Kind::Float).unwrap().contains("undefined"));
    }
}
