//! Subgroups (lesson 12): [`ProcessGroup::split`] (MPI's `MPI_Comm_split`) and
//! [`ProcessGroup::new_group`] (torch.distributed's `new_group`) make a new communicator out of
//! some of a group's ranks — a tensor-parallel group, a pipeline neighbour pair, a row or column
//! of a [`DeviceMesh`](super::mesh::DeviceMesh).
//!
//! Every rank of the parent calls the split (a collective: all of them, in the same order), saying
//! which new group it joins (its *color*, or none) and where in it (its *key*). One all-gather of
//! `(color, key)` over the parent tells every rank every group's members, ordered by key then
//! parent rank. Each new group is then a communicator of its own, with its own connections,
//! operation sequence and mismatch checks, built like the parent was:
//!
//! * **local** (threads): the first member to arrive builds the group's in-memory world; each
//!   member takes its rank's end of it;
//! * **tcp** (processes): the group's rank 0 opens a store on the address its peers reach it at
//!   (the parent's data address) on a free port, with the parent job's secret; the address goes
//!   to the members in a second all-gather over the parent; then the usual rendezvous (every
//!   connection authenticated, the mesh of sockets, shared memory on one machine);
//! * **nccl**: rank 0 of the group makes an NCCL unique id, the second all-gather hands it out,
//!   and each member joins a new NCCL communicator on its GPU (not yet run on a GPU).
//!
//! A rank that dies closes every connection it has, so it fails every group it is in. A rank
//! whose group fails while it lives on aborts its other groups too (`family.rs`: the group it was
//! split from and every subgroup of that), so each tells its own peers at once and the failure
//! spreads through the mesh instead of leaving some peers waiting out their timeout.
//!
//! Arguments are checked collectively: a bad color, key, rank list or mesh on any rank is an error
//! on every rank, and a group's rank 0 that cannot open its store (or make its NCCL id) publishes
//! why, so no member waits for it. Not yet: `spawn` runs the end-of-job checks
//! ([`ProcessGroup::finish`]) on the parent only — call a subgroup's `finish` yourself where stray
//! data matters. A member that fails between the two all-gathers leaves its peers
//! waiting in the subgroup's rendezvous until its timeout.

use super::config::Backend;
use super::error::{CommError, CommResult};
use super::group::ProcessGroup;
use super::host::HostBackend;
use super::local::{self, LocalTransport};
use super::store::{StoreClient, StoreServer};
use super::tcp::TcpTransport;
use std::collections::HashMap;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use tch::{Device, Kind, Tensor};

/// The payload of `leader`'s record, or the error it published (every member fails alike).
fn leader_record<'a>(records: &'a [Vec<i64>], leader: usize, rank: usize, what: &str) -> CommResult<&'a [i64]> {
    let r = &records[leader];
    match r[0] {
        1 => Ok(&r[1..]),
        -1 => {
            let why: Vec<u8> = r[1..].iter().take_while(|&&b| b != 0).map(|&b| b as u8).collect();
            Err(CommError::Rendezvous(format!(
                "rank {rank}: rank {leader}, the new group's rank 0, could not {what}: {}",
                String::from_utf8_lossy(&why)
            )))
        }
        _ => Err(CommError::Protocol(format!("rank {rank}: rank {leader} published nothing for the new group"))),
    }
}

/// A new identity for a local world (threads of this process).
pub(super) fn fresh_uid() -> u64 {
    let mut b = [0u8; 8];
    getrandom::getrandom(&mut b).expect("random bytes from the OS");
    u64::from_le_bytes(b)
}

type LocalKey = (u64, u64, usize);
/// Local subgroups being formed: (parent world, split number, color) → each member's transport,
/// taken by the member as it arrives.
static LOCAL_FORMING: Mutex<Option<HashMap<LocalKey, Vec<Option<LocalTransport>>>>> = Mutex::new(None);

/// Record of an address (or an NCCL id) in the second all-gather: 1 + 16 + 1 slots for an
/// address (present, IPv6-mapped bytes, port), 1 + 128 for an id.
const RECORD: i64 = 129;

impl ProcessGroup {
    /// Split this group into subgroups (MPI's `MPI_Comm_split`). **Every** rank calls it, in the
    /// same order as its other collectives: `color` names the new group this rank joins (`None`:
    /// none), `key` orders the members (ties by rank in this group). Returns this rank's new
    /// group, in which it has rank = its position among the members. Each new group is a
    /// communicator of its own (module docs); it keeps this rank's local rank, so a rank's GPU is
    /// the same in every group.
    pub fn split(&self, color: Option<usize>, key: usize) -> CommResult<Option<ProcessGroup>> {
        let (n, rank) = (self.world_size(), self.rank());
        let split = self.splits.fetch_add(1, Ordering::SeqCst);
        // (2 per rank,) i64: [color + 1 (0: none, -1: invalid), key], all-gathered over this group.
        const MAX: usize = (i64::MAX / 2) as usize;
        let invalid = color.is_some_and(|c| c > MAX) || key > MAX;
        let code = if invalid { -1 } else { color.map_or(0, |c| c as i64 + 1) };
        let mine = Tensor::from_slice(&[code, if invalid { 0 } else { key as i64 }]);
        let mut all = Tensor::zeros([2 * n as i64], (Kind::Int64, Device::Cpu));
        self.all_gather(&mut all, &mine)?;
        let all = Vec::<i64>::try_from(&all).map_err(|e| CommError::Protocol(e.to_string()))?;
        // A bad argument anywhere is an error on every rank, before anyone forms anything.
        if let Some(bad) = (0..n).find(|&r| all[2 * r] < 0) {
            return Err(CommError::InvalidArgument(format!(
                "rank {rank}: split: rank {bad} passed a color or key above {MAX}"
            )));
        }
        let Some(color) = color else {
            // Not a member: still take part in the second all-gather (it is a collective).
            self.exchange_records(None)?;
            return Ok(None);
        };
        // This rank's group: parent ranks with the same color, by (key, rank).
        let mut members: Vec<(i64, usize)> =
            (0..n).filter(|&r| all[2 * r] == color as i64 + 1).map(|r| (all[2 * r + 1], r)).collect();
        members.sort();
        let members: Vec<usize> = members.into_iter().map(|(_, r)| r).collect();
        let new_rank = members.iter().position(|&r| r == rank).expect("this rank is in its own group");
        let k = members.len();
        match self.backend() {
            Backend::Local => {
                self.exchange_records(None)?;
                let t = take_local(self.uid, split, color, k, new_rank);
                let cfg = self.config().clone();
                let host = Arc::new(HostBackend::new(Box::new(t), &cfg));
                let mut pg =
                    ProcessGroup::new(host, Backend::Local, cfg, (self.local_rank(), self.local_world_size()), None)
                        .in_family(self.family());
                pg.uid = mix(self.uid, split, color); // the same on every member
                                                      // Every member's end exists once the world is built: nothing to wait for.
                Ok(Some(pg))
            }
            Backend::Tcp => self.split_tcp(split, color, &members, new_rank),
            Backend::Nccl => self.split_nccl(&members, new_rank),
        }
    }

    /// A new group of `ranks` (torch.distributed's `new_group`): **every** rank of this group
    /// calls it with the same list, members get `Some` (rank = position in `ranks`), the others
    /// `None`. An empty list, a rank out of range or a repeated rank is an error on every rank.
    pub fn new_group(&self, ranks: &[usize]) -> CommResult<Option<ProcessGroup>> {
        let (n, rank) = (self.world_size(), self.rank());
        let mut seen = vec![false; n];
        let mut local = ranks.is_empty().then(|| "no ranks".to_string());
        for &r in ranks {
            if r >= n {
                local.get_or_insert(format!("rank {r} is out of range (world size {n})"));
            } else if std::mem::replace(&mut seen[r], true) {
                local.get_or_insert(format!("rank {r} appears twice"));
            }
        }
        // Every rank checks that all passed the same valid list (one all-reduce, max, of a digest,
        // its negation and a bad-argument flag), so that a bad list fails every rank.
        let digest =
            ranks.iter().fold(7i64, |h, &r| h.wrapping_mul(1_000_003).wrapping_add(r as i64)) & 0x3fff_ffff_ffff_ffff;
        let mut mm = Tensor::from_slice(&[digest, -digest, local.is_some() as i64]);
        self.all_reduce(&mut mm, super::ReduceOp::Max)?;
        let v = Vec::<i64>::try_from(&mm).map_err(|e| CommError::Protocol(e.to_string()))?;
        let why = local.or_else(|| {
            (v[2] != 0)
                .then(|| "another rank's list is invalid".to_string())
                .or_else(|| (v[0] != digest || -v[1] != digest).then(|| "the ranks passed different lists".to_string()))
        });
        if let Some(why) = why {
            return Err(CommError::InvalidArgument(format!("rank {rank}: new_group({ranks:?}): {why}")));
        }
        let pos = ranks.iter().position(|&r| r == rank);
        self.split(pos.map(|_| 0), pos.unwrap_or(0))
    }

    /// The second all-gather of a split: each rank's record (a new group's rank 0 publishes its
    /// store address or NCCL id — or why it has none; others nothing); returns every record.
    fn exchange_records(&self, mine: Option<Result<Vec<i64>, String>>) -> CommResult<Vec<Vec<i64>>> {
        let n = self.world_size();
        let mut rec = vec![0i64; RECORD as usize];
        match mine {
            Some(Ok(m)) => {
                rec[0] = 1;
                rec[1..1 + m.len()].copy_from_slice(&m);
            }
            Some(Err(why)) => {
                rec[0] = -1;
                for (slot, b) in rec[1..].iter_mut().zip(why.bytes()) {
                    *slot = b as i64;
                }
            }
            None => {}
        }
        let mut all = Tensor::zeros([RECORD * n as i64], (Kind::Int64, Device::Cpu));
        self.all_gather(&mut all, &Tensor::from_slice(&rec))?;
        let all = Vec::<i64>::try_from(&all).map_err(|e| CommError::Protocol(e.to_string()))?;
        Ok(all.chunks(RECORD as usize).map(|c| c.to_vec()).collect())
    }

    fn split_tcp(
        &self,
        split: u64,
        color: usize,
        members: &[usize],
        new_rank: usize,
    ) -> CommResult<Option<ProcessGroup>> {
        let rank = self.rank();
        let ip = self.data_ip.unwrap_or(IpAddr::from([127, 0, 0, 1]));
        let mut cfg = self.config().clone();
        cfg.job_id = format!("{}/split{split}/color{color}", cfg.job_id);
        cfg.fault = cfg.fault.filter(|f| f.rank == rank).map(|f| super::Fault { rank: new_rank, ..f });
        // The group's rank 0 hosts its store on the address its peers already reach it at (the
        // parent's data address; a free port). Its failure goes out in the record, so that every
        // member fails at once with the reason instead of waiting for a store that never comes.
        let secret = cfg.secret.clone();
        let server = match (new_rank, &secret) {
            (0, Some(secret)) => Some(StoreServer::bind(SocketAddr::new(ip, 0), &cfg.job_id, secret)),
            (0, None) => Some(Err(CommError::InvalidArgument("this TCP group has no job secret".into()))),
            _ => None,
        };
        let mine = match &server {
            Some(Ok(s)) => {
                let a = s.addr();
                let v6 = match a.ip() {
                    IpAddr::V4(v4) => v4.to_ipv6_mapped(),
                    IpAddr::V6(v6) => v6,
                };
                Some(Ok(v6.octets().iter().map(|&b| b as i64).chain([a.port() as i64]).collect::<Vec<i64>>()))
            }
            Some(Err(e)) => Some(Err(e.to_string())),
            None => None,
        };
        let records = self.exchange_records(mine)?;
        let leader = leader_record(&records, members[0], rank, "open the subgroup's store")?;
        let server = server.transpose()?;
        let secret = secret.expect("rank 0 of the group had the job's secret, so has every rank");
        let octets: [u8; 16] = std::array::from_fn(|i| leader[i] as u8);
        let v6 = Ipv6Addr::from(octets);
        let lip = v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4);
        let addr = SocketAddr::new(lip, leader[16] as u16).to_string();
        let mut client = StoreClient::connect(&addr, &cfg.job_id, &secret, cfg.rendezvous_timeout)?;
        if client.add(&format!("joined/{new_rank}"), 1)? > 1 {
            return Err(CommError::Rendezvous(format!("two processes joined a subgroup as rank {new_rank}")));
        }
        let t = TcpTransport::connect(new_rank, members.len(), &mut client, ip, &cfg)?;
        let host = Arc::new(HostBackend::new(Box::new(t), &cfg));
        let mut pg =
            ProcessGroup::new(host.clone(), Backend::Tcp, cfg, (self.local_rank(), self.local_world_size()), server)
                .in_family(self.family());
        pg.data_ip = Some(ip);
        pg.barrier()?;
        host.group_formed();
        if let Some(s) = &pg.store {
            s.close();
        }
        Ok(Some(pg))
    }

    fn split_nccl(&self, members: &[usize], new_rank: usize) -> CommResult<Option<ProcessGroup>> {
        let mine = (new_rank == 0).then(|| {
            super::nccl::Lib::get()
                .and_then(|lib| lib.unique_id())
                .map(|id| id.0.iter().map(|&b| b as i64).collect())
                .map_err(|e| e.to_string())
        });
        let records = self.exchange_records(mine)?;
        let leader = leader_record(&records, members[0], self.rank(), "make the NCCL id")?;
        let id = super::nccl::UniqueId(std::array::from_fn(|i| leader[i] as u8));
        let gpus = crate::device::cuda_devices().max(1);
        let cfg = self.config().clone();
        let backend =
            super::nccl::NcclBackend::new(id, new_rank, members.len(), self.local_rank() % gpus, cfg.timeout)?;
        let pg = ProcessGroup::new(
            Arc::new(backend),
            Backend::Nccl,
            cfg,
            (self.local_rank(), self.local_world_size()),
            None,
        )
        .in_family(self.family());
        pg.barrier()?;
        Ok(Some(pg))
    }
}

/// An identity for a subgroup that all its members compute alike (splitmix64 of the parts).
fn mix(uid: u64, split: u64, color: usize) -> u64 {
    let mut z = uid ^ split.rotate_left(32) ^ (color as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// This member's transport of the local subgroup (parent `uid`, `split`, `color`) of `k` ranks:
/// the first member to arrive builds the world.
fn take_local(uid: u64, split: u64, color: usize, k: usize, new_rank: usize) -> LocalTransport {
    let mut forming = super::relock(&LOCAL_FORMING);
    let map = forming.get_or_insert_with(HashMap::new);
    let key = (uid, split, color);
    let world = map.entry(key).or_insert_with(|| local::local_world(k).into_iter().map(Some).collect());
    let t = world[new_rank].take().expect("each member takes its own transport once");
    if world.iter().all(Option::is_none) {
        map.remove(&key);
    }
    t
}
