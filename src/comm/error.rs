//! Errors of the communication layer. Every failure is a value, never a hang or a panic: bad
//! arguments, rendezvous problems, ranks that disagree about a collective, dead or silent peers.

use std::time::Duration;

/// Result type of the communication layer.
pub type CommResult<T> = Result<T, CommError>;

/// What went wrong in a collective, point-to-point call or rendezvous.
///
/// `Clone` because one failure poisons the whole group: later calls on the same group return the
/// error that broke it.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CommError {
    /// The caller passed something unusable (rank out of range, wrong dtype, non-contiguous tensor…).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The ranks could not find each other (store unreachable, port in use, a rank never joined…).
    #[error("rendezvous failed: {0}")]
    Rendezvous(String),
    /// Two ranks disagree about the operation they are running (order, kind, dtype, size, root…).
    #[error("ranks disagree: {0}")]
    Mismatch(String),
    /// A peer went silent for longer than the configured timeout.
    #[error("timed out after {timeout:?} waiting for rank {peer} in {during}")]
    Timeout { peer: usize, timeout: Duration, during: String },
    /// A peer's connection broke without a goodbye (process killed, crashed, network cut).
    #[error("rank {peer} disconnected unexpectedly ({detail}); was it killed or did it crash?")]
    PeerLost { peer: usize, detail: String },
    /// A peer already shut its process group down, so the data we wait for will never come.
    #[error("rank {peer} has already shut down its process group, but this rank still expected data from it in {during} (did the ranks run different sequences of collectives?)")]
    PeerLeft { peer: usize, during: String },
    /// Another rank failed and told everybody to stop.
    #[error("aborted because rank {by} failed: {reason}")]
    Aborted { by: usize, reason: String },
    /// A connection could not be authenticated: the peer does not know the job's secret
    /// (`SHARDLAB_SECRET`), belongs to another job, or is not a shardlab endpoint at all.
    #[error("authentication failed: {0}")]
    Auth(String),
    /// Bytes on the wire that do not follow the protocol.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// An operating-system level I/O failure.
    #[error("I/O error: {0}")]
    Io(String),
    /// Training cannot go on: a non-finite gradient norm, an optimizer that refuses its slots
    /// (every rank gets this, and no update was applied).
    #[error("training step refused: {0}")]
    Step(String),
}

impl CommError {
    /// What the peers of a failed rank are told: the original failure, naming who hit it first.
    pub(crate) fn as_abort(&self, me: usize) -> CommError {
        match self {
            CommError::Aborted { .. } => self.clone(),
            e => CommError::Aborted { by: me, reason: e.to_string() },
        }
    }

    pub(crate) fn io(context: impl std::fmt::Display, e: std::io::Error) -> Self {
        CommError::Io(format!("{context}: {e}"))
    }
}
