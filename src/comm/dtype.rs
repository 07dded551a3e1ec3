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
    Sum = 1,
    /// Sum divided by the world size (floating-point dtypes only).
    Avg = 2,
    Max = 3,
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
        b.as_ptr() as usize % std::mem::align_of::<T>() == 0 && b.len() % s == 0,
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
        b.as_ptr() as usize % std::mem::align_of::<T>() == 0 && b.len() % s == 0,
        "misaligned {:p} {} {}",
        b.as_ptr(),
        b.len(),
        s
    );
    unsafe { std::slice::from_raw_parts_mut(b.as_mut_ptr() as *mut T, b.len() / s) }
}

macro_rules! combine {
    ($op:expr, $d:expr, $s:expr) => {
        match $op {
            ReduceOp::Sum | ReduceOp::Avg => $d.iter_mut().zip($s).for_each(|(d, s)| *d = *d + *s),
            ReduceOp::Max => $d.iter_mut().zip($s).for_each(|(d, s)| {
                if *s > *d {
                    *d = *s
                }
            }),
            ReduceOp::Min => $d.iter_mut().zip($s).for_each(|(d, s)| {
                if *s < *d {
                    *d = *s
                }
            }),
        }
    };
}

/// `dst[i] = dst[i] ⊕ src[i]` elementwise (for Avg this is the sum; divide once at the end).
/// Half types are combined in f32 and rounded back, as NCCL and Gloo do per hop.
pub(crate) fn reduce_into(dtype: DType, op: ReduceOp, dst: &mut [u8], src: &[u8]) {
    debug_assert_eq!(dst.len(), src.len());
    match dtype {
        DType::F32 => combine!(op, typed_mut::<f32>(dst), typed::<f32>(src)),
        DType::F64 => combine!(op, typed_mut::<f64>(dst), typed::<f64>(src)),
        DType::I64 => combine!(op, typed_mut::<i64>(dst), typed::<i64>(src)),
        DType::BF16 => half_combine(op, typed_mut::<bf16>(dst), typed::<bf16>(src)),
        DType::F16 => half_combine(op, typed_mut::<f16>(dst), typed::<f16>(src)),
    }
}

fn half_combine<H: Copy + Into<f32> + HalfFrom>(op: ReduceOp, d: &mut [H], s: &[H]) {
    for (d, s) in d.iter_mut().zip(s) {
        let (a, b): (f32, f32) = ((*d).into(), (*s).into());
        let r = match op {
            ReduceOp::Sum | ReduceOp::Avg => a + b,
            ReduceOp::Max => a.max(b),
            ReduceOp::Min => a.min(b),
        };
        *d = H::from_f32(r);
    }
}

trait HalfFrom {
    fn from_f32(v: f32) -> Self;
}
impl HalfFrom for bf16 {
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
}
impl HalfFrom for f16 {
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
}

/// `dst[i] /= n` — the final step of `ReduceOp::Avg`.
pub(crate) fn divide(dtype: DType, dst: &mut [u8], n: usize) {
    let nf = n as f64;
    match dtype {
        DType::F32 => typed_mut::<f32>(dst).iter_mut().for_each(|v| *v /= n as f32),
        DType::F64 => typed_mut::<f64>(dst).iter_mut().for_each(|v| *v /= nf),
        DType::BF16 => typed_mut::<bf16>(dst).iter_mut().for_each(|v| *v = bf16::from_f32(v.to_f32() / n as f32)),
        DType::F16 => typed_mut::<f16>(dst).iter_mut().for_each(|v| *v = f16::from_f32(v.to_f32() / n as f32)),
        DType::I64 => unreachable!("avg on integers is rejected before any communication"),
    }
}

/// A contiguous CPU tensor's storage seen as bytes, with its dtype and element count.
pub(crate) struct TensorBytes {
    ptr: *mut u8,
    pub len: usize,
    pub dtype: DType,
    pub numel: usize,
}

// The pointer refers to libtorch storage kept alive by the caller's tensor handle.
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
        Ok(TensorBytes { ptr, len: numel * dtype.size(), dtype, numel })
    }
    pub fn bytes(&self) -> &[u8] {
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
    #[allow(clippy::mut_from_ref)]
    pub fn bytes_mut(&self) -> &mut [u8] {
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}
