//! The NCCL and CUDA runtime FFI: the raw handle types, NCCL's unique id, the function table
//! [`Lib`] loaded at run time (`dlopen`/`dlsym`, never linked), the return-code checks, and
//! NCCL's codes for our dtypes and reduce ops.

use crate::comm::dtype::{DType, ReduceOp};
use crate::comm::error::{CommError, CommResult};
use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::sync::OnceLock;

pub(super) type Comm = *mut c_void;
pub(super) type Stream = *mut c_void;
pub(super) type Event = *mut c_void;

/// NCCL's 128-byte unique id: rank 0 makes it, every rank needs it to join the communicator.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct UniqueId(pub [u8; 128]);

/// The functions we use, from libnccl.so.2 and libcudart.
#[allow(clippy::type_complexity)]
pub struct Lib {
    get_version: unsafe extern "C" fn(*mut c_int) -> c_int,
    get_unique_id: unsafe extern "C" fn(*mut UniqueId) -> c_int,
    pub(super) comm_init_rank: unsafe extern "C" fn(*mut Comm, c_int, UniqueId, c_int) -> c_int,
    pub(super) comm_abort: unsafe extern "C" fn(Comm) -> c_int,
    pub(super) comm_destroy: unsafe extern "C" fn(Comm) -> c_int,
    pub(super) comm_get_async_error: unsafe extern "C" fn(Comm, *mut c_int) -> c_int,
    pub(super) error_string: unsafe extern "C" fn(c_int) -> *const c_char,
    pub(super) all_reduce: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, Comm, Stream) -> c_int,
    pub(super) broadcast: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, Comm, Stream) -> c_int,
    pub(super) all_gather: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, Comm, Stream) -> c_int,
    pub(super) reduce_scatter:
        unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, Comm, Stream) -> c_int,
    pub(super) send: unsafe extern "C" fn(*const c_void, usize, c_int, c_int, Comm, Stream) -> c_int,
    pub(super) recv: unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, Comm, Stream) -> c_int,
    pub(super) set_device: unsafe extern "C" fn(c_int) -> c_int,
    pub(super) stream_create: unsafe extern "C" fn(*mut Stream, c_uint) -> c_int,
    pub(super) stream_destroy: unsafe extern "C" fn(Stream) -> c_int,
    pub(super) event_create: unsafe extern "C" fn(*mut Event, c_uint) -> c_int,
    pub(super) event_record: unsafe extern "C" fn(Event, Stream) -> c_int,
    pub(super) event_query: unsafe extern "C" fn(Event) -> c_int,
    pub(super) event_destroy: unsafe extern "C" fn(Event) -> c_int,
    pub(super) stream_wait_event: unsafe extern "C" fn(Stream, Event, c_uint) -> c_int,
}

// Function pointers into loaded libraries (never unloaded).
unsafe impl Send for Lib {}
unsafe impl Sync for Lib {}

fn open(names: &[String]) -> Result<*mut c_void, String> {
    for n in names {
        let c = CString::new(n.as_str()).map_err(|e| e.to_string())?;
        // Already loaded (by libtorch_cuda) first, then the dynamic linker's search.
        for flags in [libc::RTLD_NOW | libc::RTLD_NOLOAD, libc::RTLD_NOW | libc::RTLD_LOCAL] {
            let h = unsafe { libc::dlopen(c.as_ptr(), flags) };
            if !h.is_null() {
                return Ok(h);
            }
        }
    }
    Err(format!("none of {names:?} could be loaded"))
}

fn sym<T: Copy>(h: *mut c_void, name: &str) -> Result<T, String> {
    let c = CString::new(name).expect("symbol name");
    let p = unsafe { libc::dlsym(h, c.as_ptr()) };
    if p.is_null() {
        return Err(format!("symbol {name} not found"));
    }
    assert_eq!(std::mem::size_of::<T>(), std::mem::size_of::<*mut c_void>());
    Ok(unsafe { std::mem::transmute_copy(&p) })
}

impl Lib {
    fn load() -> Result<Lib, String> {
        let mut nccl = vec!["libnccl.so.2".to_string(), "libnccl.so".to_string()];
        if let Ok(p) = std::env::var("SHARDLAB_NCCL_LIB") {
            nccl.insert(0, p);
        }
        let n = open(&nccl).map_err(|e| format!("NCCL: {e} (set SHARDLAB_NCCL_LIB to libnccl.so.2's path)"))?;
        let cudart: Vec<String> = ["libcudart.so.13", "libcudart.so.12", "libcudart.so"].map(String::from).to_vec();
        let c = open(&cudart).map_err(|e| format!("the CUDA runtime: {e}"))?;
        Ok(Lib {
            get_version: sym(n, "ncclGetVersion")?,
            get_unique_id: sym(n, "ncclGetUniqueId")?,
            comm_init_rank: sym(n, "ncclCommInitRank")?,
            comm_abort: sym(n, "ncclCommAbort")?,
            comm_destroy: sym(n, "ncclCommDestroy")?,
            comm_get_async_error: sym(n, "ncclCommGetAsyncError")?,
            error_string: sym(n, "ncclGetErrorString")?,
            all_reduce: sym(n, "ncclAllReduce")?,
            broadcast: sym(n, "ncclBroadcast")?,
            all_gather: sym(n, "ncclAllGather")?,
            reduce_scatter: sym(n, "ncclReduceScatter")?,
            send: sym(n, "ncclSend")?,
            recv: sym(n, "ncclRecv")?,
            set_device: sym(c, "cudaSetDevice")?,
            stream_create: sym(c, "cudaStreamCreateWithFlags")?,
            stream_destroy: sym(c, "cudaStreamDestroy")?,
            event_create: sym(c, "cudaEventCreateWithFlags")?,
            event_record: sym(c, "cudaEventRecord")?,
            event_query: sym(c, "cudaEventQuery")?,
            event_destroy: sym(c, "cudaEventDestroy")?,
            stream_wait_event: sym(c, "cudaStreamWaitEvent")?,
        })
    }

    /// NCCL and the CUDA runtime, loaded once per process.
    pub fn get() -> CommResult<&'static Lib> {
        static LIB: OnceLock<Result<Lib, String>> = OnceLock::new();
        LIB.get_or_init(Lib::load).as_ref().map_err(|e| CommError::InvalidArgument(format!("nccl backend: {e}")))
    }

    /// NCCL's version code (e.g. 22803 for 2.28.3).
    pub fn version(&self) -> CommResult<i32> {
        let mut v = 0;
        self.check(unsafe { (self.get_version)(&mut v) }, "ncclGetVersion")?;
        Ok(v)
    }

    /// A fresh unique id (rank 0's job).
    pub fn unique_id(&self) -> CommResult<UniqueId> {
        let mut id = UniqueId([0; 128]);
        self.check(unsafe { (self.get_unique_id)(&mut id) }, "ncclGetUniqueId")?;
        Ok(id)
    }

    /// `op` if this NCCL has it: `ncclAvg` came with NCCL 2.10 (version code 21000; older
    /// versions are below it in either encoding).
    pub(super) fn reduce_op(&self, op: ReduceOp, what: &str) -> CommResult<c_int> {
        if op == ReduceOp::Avg {
            let v = self.version()?;
            if v < 21000 {
                return Err(CommError::InvalidArgument(format!(
                    "{what}: Avg needs NCCL 2.10 or newer (this one is version code {v}); use Sum and divide"
                )));
            }
        }
        Ok(nccl_op(op))
    }

    pub(super) fn check(&self, r: c_int, what: &str) -> CommResult<()> {
        if r == 0 {
            return Ok(());
        }
        let msg = unsafe { CStr::from_ptr((self.error_string)(r)) }.to_string_lossy().into_owned();
        Err(CommError::Io(format!("{what}: NCCL error {r}: {msg}")))
    }
}

pub(super) fn cuda(r: c_int, what: &str) -> CommResult<()> {
    if r == 0 {
        Ok(())
    } else {
        Err(CommError::Io(format!("{what}: CUDA error {r}")))
    }
}

/// NCCL's data type for ours.
pub(super) fn nccl_type(d: DType) -> c_int {
    match d {
        DType::I64 => 4,
        DType::F16 => 6,
        DType::F32 => 7,
        DType::F64 => 8,
        DType::BF16 => 9,
    }
}

pub(super) fn nccl_op(op: ReduceOp) -> c_int {
    match op {
        ReduceOp::Sum => 0,
        ReduceOp::Max => 2,
        ReduceOp::Min => 3,
        ReduceOp::Avg => 4,
    }
}
