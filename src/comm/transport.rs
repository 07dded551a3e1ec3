//! What a transport provides to the host backend's algorithms: ordered, reliable, checked frames
//! between every pair of ranks, a simultaneous send+receive (`exchange`, the heart of every ring
//! step), and a way to fail loudly. `local` (threads, [`Backend::Local`](super::Backend)) and
//! `tcp` (processes/machines, [`Backend::Tcp`](super::Backend)) implement it; the algorithms in
//! `algo` are written once against it. (A backend that runs whole collectives itself, such as
//! NCCL, sits above this layer: see [`CommBackend`](super::CommBackend).)

use super::error::{CommError, CommResult};
use super::frame::{OpDesc, OpKind};
use std::time::Duration;

/// Called with each piece of received data: `(offset into the message, bytes)`. Offsets and
/// lengths are multiples of the element size.
pub(crate) type OnData<'a> = &'a mut dyn FnMut(usize, &[u8]) -> CommResult<()>;

/// One receive: `total` bytes of `desc` from `peer`. With `dst`, data lands there directly and
/// `on_data` sees it afterwards (e.g. to forward it); without, `on_data` consumes it (e.g. reduces it).
pub(crate) struct Recv<'a> {
    pub peer: usize,
    pub total: usize,
    pub dst: Option<&'a mut [u8]>,
    pub on_data: OnData<'a>,
}

/// A transport: the point-to-point layer under the host backend.
pub(crate) trait Transport: Send + Sync {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    /// Send `payload` to `peer` as frames of at most `chunk` bytes (one empty frame if empty).
    fn send(&self, peer: usize, desc: &OpDesc, payload: &[u8], chunk: usize, timeout: Duration) -> CommResult<()>;
    /// Receive one message.
    fn recv(&self, desc: &OpDesc, r: Recv, timeout: Duration) -> CommResult<()>;
    /// Send `payload` to `to` while receiving `r` — both directions at once, so rings never deadlock.
    fn exchange(
        &self,
        desc: &OpDesc,
        to: usize,
        payload: &[u8],
        chunk: usize,
        r: Recv,
        timeout: Duration,
    ) -> CommResult<()>;
    /// The error that broke this group, if any.
    fn poisoned(&self) -> Option<CommError>;
    /// We failed: poison ourselves and tell every peer (best effort, never blocks for long).
    fn abort(&self, err: &CommError);
    /// Clean shutdown: tell every peer that nothing more will come from us.
    fn leave(&self);
    /// Data that arrived but that no operation asked for (checked at the end of a job, when every
    /// rank has finished sending): the ranks ran different sequences of operations. Frames of
    /// `next` (the closing barrier, which fast peers may already have entered) are not stray.
    fn stray(&self, next: &OpDesc) -> Option<CommError>;
    /// A peer whose next unread frame is a point-to-point message it sent (and its description),
    /// looked at without waiting or consuming anything. Only for links at a frame boundary:
    /// between operations, or a peer the running operation does not read from.
    fn first_message(&self) -> Option<(usize, OpDesc)> {
        self.first_message_but(None)
    }
    /// [`first_message`](Transport::first_message), not looking at `skip`'s link.
    fn first_message_but(&self, skip: Option<usize>) -> Option<(usize, OpDesc)>;
    /// Every rank has joined (after rendezvous' barrier): drop what only joining needed.
    fn group_formed(&self) {}
    /// How data moves ("local", "tcp", "shm", "shm+tcp").
    fn data_path(&self) -> &'static str;
    /// Buffers that every rank reads directly (all ranks share memory), for the `Direct`
    /// algorithms; `None` where they cannot run.
    fn shared_buffers(&self) -> Option<&dyn Exchange> {
        None
    }
}

/// Buffers every rank can read directly (shared memory on one machine): the `Direct` algorithms
/// run on these instead of on frames. One step: [`begin`](Exchange::begin), [`put`](Exchange::put) this rank's part,
/// [`sync`](Exchange::sync) (publish; wait until every rank has published this step and check
/// that all run the same operation), then read the peers' parts with [`theirs`](Exchange::theirs).
/// `sync` may also be called again within a step (a second phase on the same buffers).
pub(crate) trait Exchange {
    /// Bytes of one rank's buffer.
    fn capacity(&self) -> usize;
    /// Start a step: the next of two alternating buffers (so a step's buffer is never written
    /// while a slower peer still reads the previous step's).
    fn begin(&self);
    /// Copy `src` into this rank's buffer of the current step at byte `off`.
    fn put(&self, desc: &OpDesc, off: usize, src: &[u8]) -> CommResult<()>;
    /// Publish what was put and wait until every rank has published as often.
    fn sync(&self, desc: &OpDesc, timeout: Duration) -> CommResult<()>;
    /// `len` bytes at `off` of rank `p`'s buffer of the current step (after `sync`).
    fn theirs(&self, p: usize, off: usize, len: usize) -> &[u8];
}

pub(crate) fn stray_error(me: usize, peer: usize, theirs: Option<&OpDesc>, at: &OpDesc) -> CommError {
    let what = theirs.map(|d| format!(" for {d}")).unwrap_or_default();
    CommError::Mismatch(format!(
        "rank {me} still has unread data from rank {peer}{what} when the job ended (at {at}): the ranks did not run the same collectives (a different root, count or order?)"
    ))
}

/// Whether message `m` was sent before its sender entered collective `c` (it had run fewer
/// collectives than `c`'s number then; `c.seq` counts the collectives before `c`).
pub(crate) fn sent_before(m: &OpDesc, c: &OpDesc) -> bool {
    m.op == OpKind::P2p && m.after <= c.seq
}

/// The error of a collective that finds a point-to-point message of peer `p` waiting first.
pub(crate) fn message_first_error(me: usize, desc: &OpDesc, p: usize, theirs: &OpDesc) -> CommError {
    CommError::Mismatch(format!(
        "rank {me} is running {desc} but rank {p} sent it a message first ({theirs}) that rank {me} has not received: \
         the ranks called send/recv and collectives in different orders"
    ))
}

/// Check an incoming frame against what this rank runs; `room` = bytes still expected.
pub(crate) fn check_frame(
    me: usize,
    peer: usize,
    mine: &OpDesc,
    theirs: &OpDesc,
    len: usize,
    room: usize,
) -> CommResult<()> {
    if theirs.op == OpKind::P2p && theirs.after != mine.after && *theirs == (OpDesc { after: theirs.after, ..*mine }) {
        return Err(CommError::Mismatch(format!(
            "rank {peer} sent message #{} after {} collectives of the group, rank {me} receives it after {}: \
             the ranks called send/recv and collectives in different orders",
            mine.seq, theirs.after, mine.after
        )));
    }
    if theirs.op == OpKind::P2p && mine.op != OpKind::P2p {
        return Err(message_first_error(me, mine, peer, theirs));
    }
    if mine.op == OpKind::P2p && theirs.op != OpKind::P2p {
        return Err(CommError::Mismatch(format!(
            "rank {me} waits for {mine} but rank {peer} sent data for {theirs} first: \
             the ranks called send/recv and collectives in different orders"
        )));
    }
    if theirs != mine {
        return Err(CommError::Mismatch(format!("rank {me} is running {mine} but rank {peer} sent data for {theirs}")));
    }
    if len > room || !len.is_multiple_of(mine.dtype.size()) || (len == 0 && room > 0) {
        return Err(CommError::Protocol(format!(
            "rank {peer} sent a {len}-byte frame where rank {me} expected {room} more bytes in {mine}"
        )));
    }
    Ok(())
}
