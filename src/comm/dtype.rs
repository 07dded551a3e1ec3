//! Element types the collectives understand, the reduction kernels over raw bytes, and the
//! (unsafe, checked) view of a contiguous CPU tensor's storage as bytes.

use super::error::{CommError, CommResult};
use half::{bf16, f16};
use tch::{Device, Kind, Tensor};

/// Element type of a buffer on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum DType {
    F32 = 1,
    F64 = 2,
    BF16 = 3,
    F16 = 4,
    I64 = 5,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F64 | DType::I64 => 8,
            DType::BF16 | DType::F16 => 2,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::I64 => "i64",
        }
    }
    pub fn from_kind(kind: Kind) -> CommResult<Self> {
        Ok(match kind {
            Kind::Float => DType::F32,
            Kind::Double => DType::F64,
            Kind::BFloat16 => DType::BF16,
            Kind::Half => DType::F16,
            Kind::Int64 => DType::I64,
            other => {
                return Err(CommError::InvalidArgument(format!(
                    "dtype {other:?} is not supported (use f32, f64, bf16, f16 or i64)"
                )))
            }
        })
    }
    pub fn kind(self) -> Kind {
        match self {
            DType::F32 => Kind::Float,
            DType::F64 => Kind::Double,
            DType::BF16 => Kind::BFloat16,
            DType::F16 => Kind::Half,
            DType::I64 => Kind::Int64,
        }
    }
    pub(crate) fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            1 => DType::F32,
            2 => DType::F64,
            3 => DType::BF16,
            4 => DType::F16,
            5 => DType::I64,
            _ => return None,
        })
    }
}

/// How to combine the ranks' values in `all_reduce` and `reduce_scatter`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[repr(u8)]
pub enum ReduceOp {
    /// Integer sums wrap on overflow (two's complement), as in torch and NCCL.
    Sum = 1,
    /// Mean over the ranks (floating-point dtypes only). f32/f64 divide the sum by the world size;
    /// bf16/f16 divide each rank's contribution before summing, so the sum cannot overflow when the
    /// mean is representable (as NCCL does).
    Avg = 2,
    /// Elementwise maximum; NaN if any rank has NaN there (like `torch.maximum`).
    Max = 3,
    /// Elementwise minimum; NaN if any rank has NaN there (like `torch.minimum`).
    Min = 4,
}

impl ReduceOp {
    pub(crate) fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            1 => ReduceOp::Sum,
            2 => ReduceOp::Avg,
            3 => ReduceOp::Max,
            4 => ReduceOp::Min,
            _ => return None,
        })
    }
}

/// Reinterpret bytes as a slice of `T`. Panics on misalignment (our buffers are 8-byte aligned).
fn typed<T>(b: &[u8]) -> &[T] {
    if b.is_empty() {
        return &[];
    }
    let s = std::mem::size_of::<T>();
    assert!(
        (b.as_ptr() as usize).is_multiple_of(std::mem::align_of::<T>()) && b.len().is_multiple_of(s),
        "misaligned {:p} {} {}",
        b.as_ptr(),
        b.len(),
        s
    );
    unsafe { std::slice::from_raw_parts(b.as_ptr() as *const T, b.len() / s) }
}
fn typed_mut<T>(b: &mut [u8]) -> &mut [T] {
    if b.is_empty() {
        return &mut [];
    }
    let s = std::mem::size_of::<T>();
    assert!(
        (b.as_ptr() as usize).is_multiple_of(std::mem::align_of::<T>()) && b.len().is_multiple_of(s),
        "misaligned {:p} {} {}",
        b.as_ptr(),
        b.len(),
        s
    );
    unsafe { std::slice::from_raw_parts_mut(b.as_mut_ptr() as *mut T, b.len() / s) }
}

/// What the reduction kernels need from an element type.
trait Elem: Copy + PartialOrd {
    /// `Sum`'s `+`: IEEE addition for floats (half types in f32, rounded back), two's-complement
    /// wrapping for integers.
    fn add(self, other: Self) -> Self;
    fn is_nan(self) -> bool;
}

impl Elem for f32 {
    #[inline(always)]
    fn add(self, o: Self) -> Self {
        self + o
    }
    #[inline(always)]
    fn is_nan(self) -> bool {
        f32::is_nan(self)
    }
}
impl Elem for f64 {
    #[inline(always)]
    fn add(self, o: Self) -> Self {
        self + o
    }
    #[inline(always)]
    fn is_nan(self) -> bool {
        f64::is_nan(self)
    }
}
/// Integer sums wrap on overflow, as torch and NCCL do. A plain `+` would panic in builds with
/// overflow checks (the dev profile), so another rank's data could kill this rank.
impl Elem for i64 {
    #[inline(always)]
    fn add(self, o: Self) -> Self {
        self.wrapping_add(o)
    }
    #[inline(always)]
    fn is_nan(self) -> bool {
        false
    }
}
/// Half types are added in f32 and rounded back, as NCCL and Gloo do per hop.
impl Elem for bf16 {
    #[inline(always)]
    fn add(self, o: Self) -> Self {
        bf16::from_f32(self.to_f32() + o.to_f32())
    }
    #[inline(always)]
    fn is_nan(self) -> bool {
        bf16::is_nan(self)
    }
}
impl Elem for f16 {
    #[inline(always)]
    fn add(self, o: Self) -> Self {
        f16::from_f32(self.to_f32() + o.to_f32())
    }
    #[inline(always)]
    fn is_nan(self) -> bool {
        f16::is_nan(self)
    }
}

/// `dst[i] = dst[i] ⊕ src[i]`. Max and Min propagate NaN like `torch.maximum`/`torch.minimum`:
/// if either operand is NaN the result is NaN, whichever operand it was, so every rank order gives
/// the same answer. (`s > d || s.is_nan()` is a branch-free select and vectorises.)
#[inline(always)]
fn combine<T: Elem>(op: ReduceOp, d: &mut [T], s: &[T]) {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => d.iter_mut().zip(s).for_each(|(d, s)| *d = d.add(*s)),
        ReduceOp::Max => d.iter_mut().zip(s).for_each(|(d, s)| *d = if *s > *d || s.is_nan() { *s } else { *d }),
        ReduceOp::Min => d.iter_mut().zip(s).for_each(|(d, s)| *d = if *s < *d || s.is_nan() { *s } else { *d }),
    }
}

/// `dst[i] = dst[i] ⊕ src[i]` elementwise. For Avg this is the sum: see [`avg_premultiplies`] for
/// where the division by n happens.
pub(crate) fn reduce_into(dtype: DType, op: ReduceOp, dst: &mut [u8], src: &[u8]) {
    debug_assert_eq!(dst.len(), src.len());
    match dtype {
        DType::F32 => combine(op, typed_mut::<f32>(dst), typed::<f32>(src)),
        DType::F64 => combine(op, typed_mut::<f64>(dst), typed::<f64>(src)),
        DType::I64 => combine(op, typed_mut::<i64>(dst), typed::<i64>(src)),
        DType::BF16 => combine(op, typed_mut::<bf16>(dst), typed::<bf16>(src)),
        DType::F16 => combine(op, typed_mut::<f16>(dst), typed::<f16>(src)),
    }
}

/// Where `ReduceOp::Avg` divides by the world size n.
///
/// * bf16/f16 (`true`): every rank scales its own contribution by 1/n *before* anything is
///   combined or sent ([`premultiply`]; NCCL's "premultiply"), so no partial sum exceeds the largest
///   input: 4 ranks × 60000 would overflow f16 (max 65504) to inf although the mean is representable.
/// * f32/f64 (`false`): sum, then divide the finished sum once ([`divide`]), as Gloo does. The sum
///   is exact for the integer-valued tensors the tests use, so the mean is rounded once, and an f32
///   sum of gradients does not come near overflow (3.4e38).
pub(crate) fn avg_premultiplies(dtype: DType) -> bool {
    matches!(dtype, DType::BF16 | DType::F16)
}

/// `dst[i] = src[i] / n` (`src` = None: in place) — the first step of `Avg` on bf16/f16.
/// The quotient is computed in f32 and rounded once to the half type; for fewer than 4096 ranks
/// that equals the correctly rounded x/n.
pub(crate) fn premultiply(dtype: DType, dst: &mut [u8], src: Option<&[u8]>, n: usize) {
    fn scale<H: Half>(d: &mut [H], s: Option<&[H]>, n: usize) {
        let nf = n as f32;
        match s {
            Some(s) => d.iter_mut().zip(s).for_each(|(d, s)| *d = H::from_f32(s.to_f32() / nf)),
            None => d.iter_mut().for_each(|d| *d = H::from_f32(d.to_f32() / nf)),
        }
    }
    debug_assert!(src.is_none_or(|s| s.len() == dst.len()));
    match dtype {
        DType::BF16 => scale(typed_mut::<bf16>(dst), src.map(typed::<bf16>), n),
        DType::F16 => scale(typed_mut::<f16>(dst), src.map(typed::<f16>), n),
        _ => unreachable!("Avg premultiplies only bf16/f16 (see avg_premultiplies)"),
    }
}

trait Half: Copy {
    fn to_f32(self) -> f32;
    fn from_f32(v: f32) -> Self;
}
impl Half for bf16 {
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
}
impl Half for f16 {
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
}

/// `dst[i] /= n` — the last step of `Avg` on f32/f64 (see [`avg_premultiplies`]).
pub(crate) fn divide(dtype: DType, dst: &mut [u8], n: usize) {
    match dtype {
        DType::F32 => typed_mut::<f32>(dst).iter_mut().for_each(|v| *v /= n as f32),
        DType::F64 => typed_mut::<f64>(dst).iter_mut().for_each(|v| *v /= n as f64),
        _ => unreachable!("Avg divides the sum only for f32/f64; bf16/f16 premultiply, i64 is rejected"),
    }
}

/// A contiguous CPU tensor's storage seen as bytes, with its dtype and element count. It holds a
/// handle of the tensor, so the storage lives as long as the view (an operation that runs after
/// its caller dropped the tensor still writes valid memory).
pub(crate) struct TensorBytes {
    ptr: *mut u8,
    pub len: usize,
    pub dtype: DType,
    pub numel: usize,
    _storage: Tensor,
}

// The pointer refers to libtorch storage kept alive by `_storage`.
unsafe impl Send for TensorBytes {}

impl TensorBytes {
    /// Check that `t` can be communicated and take a view of its bytes.
    ///
    /// Safety contract (documented on the public API): while a collective runs on `t`, nobody else
    /// reads or writes its storage — the same rule as for PyTorch's async collectives.
    pub fn of(t: &Tensor, what: &str) -> CommResult<Self> {
        if !t.defined() {
            return Err(CommError::InvalidArgument(format!("{what}: tensor is undefined")));
        }
        if t.device() != Device::Cpu {
            return Err(CommError::InvalidArgument(format!(
                "{what}: tensor is on {:?}; this backend moves CPU tensors (use the NCCL backend for CUDA)",
                t.device()
            )));
        }
        if !t.is_contiguous() {
            return Err(CommError::InvalidArgument(format!(
                "{what}: tensor is not contiguous (call .contiguous() first)"
            )));
        }
        let dtype = DType::from_kind(t.kind()).map_err(|e| match e {
            CommError::InvalidArgument(m) => CommError::InvalidArgument(format!("{what}: {m}")),
            e => e,
        })?;
        let numel = t.numel();
        let ptr =
            if numel == 0 { std::ptr::NonNull::<u64>::dangling().as_ptr() as *mut u8 } else { t.data_ptr() as *mut u8 };
        Ok(TensorBytes { ptr, len: numel * dtype.size(), dtype, numel, _storage: t.shallow_clone() })
    }
    pub fn bytes(&self) -> &[u8] {
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
    #[allow(clippy::mut_from_ref)]
    pub fn bytes_mut(&self) -> &mut [u8] {
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}
