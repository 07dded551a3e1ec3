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
//! A rank that dies closes every connection it has, so it fails every group it is in; an error in
//! one group does not abort the others (as in PyTorch, where each process group has its own
//! watchdog): a job that cannot go on fails on its next operation in any of them.

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
        // (2 per rank,) i64: [color + 1 (0: none), key], all-gathered over this group.
        let mine = Tensor::from_slice(&[color.map_or(0, |c| c as i64 + 1), key as i64]);
        let mut all = Tensor::zeros([2 * n as i64], (Kind::Int64, Device::Cpu));
        self.all_gather(&mut all, &mine)?;
        let all = Vec::<i64>::try_from(&all).map_err(|e| CommError::Protocol(e.to_string()))?;
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
                    ProcessGroup::new(host, Backend::Local, cfg, (self.local_rank(), self.local_world_size()), None);
                pg.uid = mix(self.uid, split, color); // the same on every member
                pg.barrier()?;
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
        let n = self.world_size();
        let mut seen = vec![false; n];
        for &r in ranks {
            if r >= n || std::mem::replace(&mut seen[r], true) {
                return Err(CommError::InvalidArgument(format!(
                    "rank {}: new_group({ranks:?}): {} (world size {n})",
                    self.rank(),
                    if r >= n { format!("rank {r} is out of range") } else { format!("rank {r} appears twice") }
                )));
            }
        }
        if ranks.is_empty() {
            return Err(CommError::InvalidArgument(format!("rank {}: new_group([]): no ranks", self.rank())));
        }
        let pos = ranks.iter().position(|&r| r == self.rank());
        self.split(pos.map(|_| 0), pos.unwrap_or(0))
    }

    /// The second all-gather of a split: each rank's record (a new group's rank 0 publishes its
    /// store address or NCCL id; others nothing); returns every rank's record.
    fn exchange_records(&self, mine: Option<Vec<i64>>) -> CommResult<Vec<Vec<i64>>> {
        let n = self.world_size();
        let mut rec = vec![0i64; RECORD as usize];
        if let Some(m) = mine {
            rec[0] = 1;
            rec[1..1 + m.len()].copy_from_slice(&m);
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
        cfg.fault = None;
        let secret = cfg
            .secret
            .clone()
            .ok_or_else(|| CommError::InvalidArgument(format!("rank {rank}: this TCP group has no job secret")))?;
        // The group's rank 0 hosts its store on the address its peers already reach it at.
        let server =
            if new_rank == 0 { Some(StoreServer::bind(SocketAddr::new(ip, 0), &cfg.job_id, &secret)?) } else { None };
        let mine = server.as_ref().map(|s| {
            let a = s.addr();
            let v6 = match a.ip() {
                IpAddr::V4(v4) => v4.to_ipv6_mapped(),
                IpAddr::V6(v6) => v6,
            };
            v6.octets().iter().map(|&b| b as i64).chain([a.port() as i64]).collect::<Vec<i64>>()
        });
        let records = self.exchange_records(mine)?;
        let leader = &records[members[0]];
        if leader[0] != 1 {
            return Err(CommError::Protocol(format!("rank {rank}: rank {} published no store address", members[0])));
        }
        let octets: [u8; 16] = std::array::from_fn(|i| leader[1 + i] as u8);
        let v6 = Ipv6Addr::from(octets);
        let lip = v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4);
        let addr = SocketAddr::new(lip, leader[17] as u16).to_string();
        let mut client = StoreClient::connect(&addr, &cfg.job_id, &secret, cfg.rendezvous_timeout)?;
        if client.add(&format!("joined/{new_rank}"), 1)? > 1 {
            return Err(CommError::Rendezvous(format!("two processes joined a subgroup as rank {new_rank}")));
        }
        let t = TcpTransport::connect(new_rank, members.len(), &mut client, ip, &cfg)?;
        let host = Arc::new(HostBackend::new(Box::new(t), &cfg));
        let mut pg =
            ProcessGroup::new(host.clone(), Backend::Tcp, cfg, (self.local_rank(), self.local_world_size()), server);
        pg.data_ip = Some(ip);
        pg.barrier()?;
        host.group_formed();
        if let Some(s) = &pg.store {
            s.close();
        }
        Ok(Some(pg))
    }

    fn split_nccl(&self, members: &[usize], new_rank: usize) -> CommResult<Option<ProcessGroup>> {
        let lib = super::nccl::Lib::get()?;
        let mine = if new_rank == 0 { Some(lib.unique_id()?.0.iter().map(|&b| b as i64).collect()) } else { None };
        let records = self.exchange_records(mine)?;
        let leader = &records[members[0]];
        if leader[0] != 1 {
            return Err(CommError::Protocol(format!("rank {}: no NCCL id from rank {}", self.rank(), members[0])));
        }
        let id = super::nccl::UniqueId(std::array::from_fn(|i| leader[1 + i] as u8));
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
        );
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
