//! Tensor checks for graders: a tensor's shape and kind before its values. libtorch broadcasts,
//! so the right values in a `[1, n]` compared with an expected `[n]` would pass, and a `[n, 1]`
//! would broadcast to `[n, n]` and fail with a misleading difference; a shape that does not
//! broadcast at all would fail inside libtorch, with a message about the grader's code.

use tch::{Kind, Tensor};

/// Panic, naming `what`, unless `got` has exactly the shape `shape` and the kind `kind`.
pub fn assert_layout(got: &Tensor, shape: &[i64], kind: Kind, what: &str) {
    if !got.defined() {
        panic!("{what}: an undefined tensor (`Tensor::new()`?), want shape {shape:?} {kind:?}");
    }
    let (s, k) = (got.size(), got.kind());
    if s != shape || k != kind {
        let why = if s != shape && got.numel() as i64 == shape.iter().product::<i64>() {
            " (the right number of elements in the wrong shape: a view or reshape too many, or too few?)"
        } else if s != shape {
            ""
        } else {
            " (a conversion too many, or one missing?)"
        };
        panic!("{what}: shape {s:?} {k:?}, want {shape:?} {kind:?}{why}");
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

/// Whether `a` is `b`'s memory as it stands: same device, address, shape and strides (a view of
/// other elements, or of the same elements in another shape, is not).
pub fn same_memory(a: &Tensor, b: &Tensor) -> bool {
    a.defined()
        && b.defined()
        && a.device() == b.device()
        && a.data_ptr() == b.data_ptr()
        && a.size() == b.size()
        && a.stride() == b.stride()
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
    }
}
