//! The unit on the wire: a 48-byte header describing the collective it belongs to, then a payload.
//!
//! Every frame repeats the full description of its operation (kind, sequence number, dtype, element
//! count, origin/reduction/algorithm), so a receiver checks each frame against what *it* is running and two
//! ranks that disagree are caught at the first byte they exchange instead of corrupting data or
//! hanging.

use super::dtype::{DType, ReduceOp};
use super::error::{CommError, CommResult};
use std::sync::{Arc, Mutex};

pub(crate) const MAGIC: u32 = 0x5348_4c42; // "SHLB"
pub(crate) const HEADER_LEN: usize = 48;
/// Upper bound of one frame's payload; protects readers from garbage lengths.
pub(crate) const MAX_FRAME: usize = 64 << 20;

/// Which operation a frame belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum OpKind {
    Barrier = 1,
    /// A point-to-point message: one rank's `send` and the matching `recv` on its peer.
    P2p = 2,
    Broadcast = 3,
    AllReduce = 4,
    AllGather = 5,
    ReduceScatter = 6,
}

impl OpKind {
    pub fn name(self) -> &'static str {
        match self {
            OpKind::Barrier => "barrier",
            OpKind::P2p => "send/recv",
            OpKind::Broadcast => "broadcast",
            OpKind::AllReduce => "all_reduce",
            OpKind::AllGather => "all_gather",
            OpKind::ReduceScatter => "reduce_scatter",
        }
    }
    fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            1 => OpKind::Barrier,
            2 => OpKind::P2p,
            3 => OpKind::Broadcast,
            4 => OpKind::AllReduce,
            5 => OpKind::AllGather,
            6 => OpKind::ReduceScatter,
            _ => return None,
        })
    }
}

/// The full description of one operation, identical on every participating rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpDesc {
    pub op: OpKind,
    /// Collective sequence number of the group (for send/recv: per-pair message number).
    pub seq: u64,
    pub dtype: DType,
    /// Elements of the tensor the op is called with (all_gather: the input; reduce_scatter: the input).
    pub numel: u64,
    /// The rank the data comes from, where one rank is the source: broadcast's root, a
    /// message's sender; else 0.
    pub origin: u32,
    pub reduce: Option<ReduceOp>,
    /// Algorithm code (see `Algo`), so ranks running different algorithms are caught too.
    pub algo: u8,
    /// Send/recv: how many collectives of the group the rank had run before it (else 0). A
    /// message must sit between the same collectives on both ranks; a message sent before a
    /// collective and received after it is caught wherever it is seen first.
    pub after: u64,
}

impl OpDesc {
    /// `op` on `numel` elements of `dtype`: sequence number 0 (the backend numbers it when it
    /// runs), origin 0, no reduction, the naive algorithm. Set the other fields with struct
    /// update syntax: `OpDesc { origin: root as u32, ..OpDesc::new(..) }`.
    pub fn new(op: OpKind, dtype: DType, numel: usize) -> Self {
        OpDesc {
            op,
            seq: 0,
            dtype,
            numel: numel as u64,
            origin: 0,
            reduce: None,
            algo: super::Algo::Naive as u8,
            after: 0,
        }
    }
}

impl std::fmt::Display for OpDesc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} #{} ({} × {}", self.op.name(), self.seq, self.numel, self.dtype.name())?;
        match self.op {
            OpKind::Broadcast => write!(f, ", root {}", self.origin)?,
            OpKind::P2p => write!(f, ", from rank {}, after {} collectives", self.origin, self.after)?,
            _ => {}
        }
        if let Some(r) = self.reduce {
            write!(f, ", {r:?}")?;
        }
        write!(f, ", algo {})", super::Algo::from_u8(self.algo).map(|a| a.name()).unwrap_or("?"))
    }
}

/// Frame kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum FrameKind {
    Data = 1,
    /// The sender failed; payload is the reason (UTF-8).
    Abort = 2,
    /// The sender shut its group down cleanly; nothing more will come.
    Leave = 3,
}

pub(crate) fn encode_header(kind: FrameKind, d: &OpDesc, len: usize) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[0..4].copy_from_slice(&MAGIC.to_le_bytes());
    h[4] = kind as u8;
    h[5] = d.op as u8;
    h[6] = d.dtype as u8;
    h[7] = d.reduce.map(|r| r as u8).unwrap_or(0);
    h[8..16].copy_from_slice(&d.seq.to_le_bytes());
    h[16..24].copy_from_slice(&d.numel.to_le_bytes());
    h[24..28].copy_from_slice(&d.origin.to_le_bytes());
    h[28] = d.algo;
    h[32..40].copy_from_slice(&(len as u64).to_le_bytes());
    h[40..48].copy_from_slice(&d.after.to_le_bytes());
    h
}

/// Decode and sanity-check a header; returns the kind, description and payload length.
pub(crate) fn decode_header(h: &[u8; HEADER_LEN]) -> CommResult<(FrameKind, OpDesc, usize)> {
    let bad = |what: &str| CommError::Protocol(format!("bad frame header ({what})"));
    if u32::from_le_bytes(h[0..4].try_into().unwrap()) != MAGIC {
        return Err(bad("magic"));
    }
    let kind = match h[4] {
        1 => FrameKind::Data,
        2 => FrameKind::Abort,
        3 => FrameKind::Leave,
        _ => return Err(bad("kind")),
    };
    let len = u64::from_le_bytes(h[32..40].try_into().unwrap());
    if len > MAX_FRAME as u64 {
        return Err(bad("payload length"));
    }
    // Abort/Leave frames carry a dummy description.
    let op = OpKind::from_u8(h[5]).unwrap_or(OpKind::Barrier);
    let dtype = DType::from_u8(h[6]).unwrap_or(DType::F32);
    if kind == FrameKind::Data && (OpKind::from_u8(h[5]).is_none() || DType::from_u8(h[6]).is_none()) {
        return Err(bad("op/dtype"));
    }
    let desc = OpDesc {
        op,
        seq: u64::from_le_bytes(h[8..16].try_into().unwrap()),
        dtype,
        numel: u64::from_le_bytes(h[16..24].try_into().unwrap()),
        origin: u32::from_le_bytes(h[24..28].try_into().unwrap()),
        reduce: ReduceOp::from_u8(h[7]),
        algo: h[28],
        after: u64::from_le_bytes(h[40..48].try_into().unwrap()),
    };
    Ok((kind, desc, len as usize))
}

/// The description Abort and Leave frames carry (nothing).
pub(crate) const NO_DESC: OpDesc =
    OpDesc { op: OpKind::Barrier, seq: 0, dtype: DType::F32, numel: 0, origin: 0, reduce: None, algo: 0, after: 0 };

/// A received payload in a recycled, 8-byte aligned buffer.
pub(crate) struct Buf {
    data: Vec<u64>,
    len: usize,
    pool: Arc<BufPool>,
}

impl Buf {
    pub fn bytes(&self) -> &[u8] {
        unsafe { std::slice::from_raw_parts(self.data.as_ptr() as *const u8, self.len) }
    }
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        unsafe { std::slice::from_raw_parts_mut(self.data.as_mut_ptr() as *mut u8, self.len) }
    }
}

impl Drop for Buf {
    fn drop(&mut self) {
        self.pool.put(std::mem::take(&mut self.data));
    }
}

/// Keeps freed payload buffers so steady-state traffic does no allocation and no page faults.
#[derive(Default)]
pub(crate) struct BufPool {
    free: Mutex<Vec<Vec<u64>>>,
}

const POOL_KEEP: usize = 64;

impl BufPool {
    pub fn new() -> Arc<Self> {
        Arc::new(BufPool::default())
    }
    pub fn get(self: &Arc<Self>, len: usize) -> Buf {
        let words = len.div_ceil(8).max(1);
        let found = {
            let mut free = super::relock(&self.free);
            free.iter().rposition(|v| v.len() >= words).map(|i| free.swap_remove(i))
        };
        let data = found.unwrap_or_else(|| vec![0u64; words]);
        Buf { data, len, pool: self.clone() }
    }
    fn put(&self, v: Vec<u64>) {
        if v.is_empty() {
            return;
        }
        let mut free = super::relock(&self.free);
        if free.len() < POOL_KEEP {
            free.push(v);
        }
    }
}
