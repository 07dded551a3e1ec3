//! How a [`ProcessGroup`] comes to be: [`ProcessGroup::local_world`] (ranks are threads of this
//! process) and [`ProcessGroup::init_tcp`] / [`ProcessGroup::from_env`] (ranks are processes
//! that find each other through the TCP store at MASTER_ADDR:MASTER_PORT, as torchrun sets
//! them up). Both build the host backend over their transport.

use super::auth::{self, local_secret, SecretFrom};
use super::config::{env_num, Backend, CommConfig};
use super::error::{CommError, CommResult};
use super::group::ProcessGroup;
use super::host::HostBackend;
use super::local;
use super::store::{StoreClient, StoreServer};
use super::tcp::TcpTransport;
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// Where and who a TCP rank is — what torchrun puts in the environment.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TcpInit {
    pub rank: usize,
    pub world_size: usize,
    pub master_addr: String,
    pub master_port: u16,
    pub local_rank: usize,
    pub local_world_size: usize,
}

impl TcpInit {
    /// Rank `rank` of `world_size` ranks all on this machine, the store on 127.0.0.1:`port`.
    pub fn loopback(rank: usize, world_size: usize, port: u16) -> Self {
        TcpInit {
            rank,
            world_size,
            master_addr: "127.0.0.1".into(),
            master_port: port,
            local_rank: rank,
            local_world_size: world_size,
        }
    }

    /// Read RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK, LOCAL_WORLD_SIZE — as torchrun
    /// or the `launch` bin set them. Under Slurm (`srun`, one task per rank) the missing ones come
    /// from SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, this node's count in
    /// SLURM_STEP_TASKS_PER_NODE (SLURM_NTASKS_PER_NODE is set only with `--ntasks-per-node`), and
    /// MASTER_ADDR from the first host of the step's node list (SLURM_STEP_NODELIST, else the
    /// job's).
    pub fn from_env() -> CommResult<Self> {
        Self::from_lookup(&|n| std::env::var(n).ok())
    }

    /// [`from_env`](Self::from_env) from `get` (a name → its value) instead of the environment.
    pub fn from_lookup(get: &dyn Fn(&str) -> Option<String>) -> CommResult<Self> {
        let var = |names: &[&str], default: Option<usize>| -> CommResult<usize> { lookup_var(get, names, default) };
        let rank = var(&["RANK", "SLURM_PROCID"], None)?;
        let world_size = var(&["WORLD_SIZE", "SLURM_NTASKS"], None)?;
        let master_addr = match get("MASTER_ADDR") {
            Some(a) => a,
            None => ["SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"]
                .iter()
                .find_map(|n| get(n))
                .and_then(|l| first_host(&l))
                .unwrap_or_else(|| "127.0.0.1".into()),
        };
        let port = |names: &[&str], default: Option<u16>| -> CommResult<u16> {
            lookup_var(get, names, default.map(usize::from)).and_then(|p| {
                u16::try_from(p).map_err(|_| CommError::InvalidArgument(format!("port {p} is out of range")))
            })
        };
        // torchrun's agent already hosts its own store on MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE):
        // ours then listens one port up (or on SHARDLAB_STORE_PORT), the same on every rank.
        let master_port = match (get("SHARDLAB_STORE_PORT"), get("TORCHELASTIC_USE_AGENT_STORE")) {
            (Some(_), _) => port(&["SHARDLAB_STORE_PORT"], None)?,
            (None, Some(v)) if v.eq_ignore_ascii_case("true") => port(&["MASTER_PORT"], Some(29500))?
                .checked_add(1)
                .ok_or_else(|| CommError::InvalidArgument("MASTER_PORT 65535 leaves no port for our store".into()))?,
            _ => port(&["MASTER_PORT"], Some(29500))?,
        };
        let on_this_node = get("SLURM_STEP_TASKS_PER_NODE")
            .zip(get("SLURM_NODEID").and_then(|v| v.trim().parse::<usize>().ok()))
            .and_then(|(spec, node)| tasks_on_node(&spec, node));
        let local_world_size = match (get("LOCAL_WORLD_SIZE"), on_this_node) {
            (None, Some(n)) => n,
            _ => var(&["LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"], Some(world_size))?,
        };
        Ok(TcpInit {
            rank,
            world_size,
            master_addr,
            master_port,
            local_rank: var(&["LOCAL_RANK", "SLURM_LOCALID"], Some(rank))?,
            local_world_size,
        })
    }
}

/// The first of `names` that `get` has, parsed, else `default` (or an error naming them).
fn lookup_var(get: &dyn Fn(&str) -> Option<String>, names: &[&str], default: Option<usize>) -> CommResult<usize> {
    match names.iter().find_map(|n| get(n).map(|v| (n, v))) {
        Some((name, v)) => {
            v.trim().parse().map_err(|_| CommError::InvalidArgument(format!("{name}={v:?} is not a valid number")))
        }
        None => default.ok_or_else(|| {
            CommError::InvalidArgument(format!(
                "{} is not set (expected as torchrun, the launch bin or srun sets it)",
                names.join(" or ")
            ))
        }),
    }
}

/// The tasks on node `node` of a Slurm step from SLURM_STEP_TASKS_PER_NODE's compressed form:
/// `"4"`, `"2(x3),1"` (three nodes of 2, then one of 1).
pub fn tasks_on_node(spec: &str, node: usize) -> Option<usize> {
    let mut at = 0;
    for part in spec.split(',') {
        let part = part.trim();
        let (n, times) = match part.split_once("(x") {
            Some((n, t)) => (n.parse::<usize>().ok()?, t.strip_suffix(')')?.parse::<usize>().ok()?),
            None => (part.parse::<usize>().ok()?, 1),
        };
        if node < at + times {
            return Some(n);
        }
        at += times;
    }
    None
}

/// The rendezvous the tcp and nccl backends share: check the rank, settle the job's secret (into
/// `cfg`), host the store on rank 0, connect to it, and refuse two processes claiming one rank.
/// Rank 0 also gets the file its run's secret is left in, if it made one: keep it until the
/// group has formed.
fn join_store(init: &TcpInit, cfg: &mut CommConfig) -> CommResult<(Option<StoreServer>, StoreClient, SecretKept)> {
    let (rank, n) = (init.rank, init.world_size);
    if n == 0 {
        return Err(CommError::InvalidArgument("WORLD_SIZE must be at least 1".into()));
    }
    if rank >= n {
        return Err(CommError::InvalidArgument(format!("RANK {rank} is out of range for WORLD_SIZE {n}")));
    }
    cfg.validate()?;
    let (mut secret, from) = auth::job_secret(cfg, rank, &init.master_addr, init.master_port)?;
    let master = format!("{}:{}", init.master_addr, init.master_port);
    let server = if rank == 0 {
        let ip: std::net::IpAddr = cfg.store_bind.parse().map_err(|_| {
            CommError::InvalidArgument(format!("SHARDLAB_STORE_BIND {:?} is not an IP address", cfg.store_bind))
        })?;
        Some(StoreServer::bind(std::net::SocketAddr::new(ip, init.master_port), &cfg.job_id, &secret)?)
    } else {
        None
    };
    // A secret drawn for this run goes to the other ranks once the port is ours.
    let kept = match from {
        SecretFrom::Drawn => Some(local_secret::publish(&cfg.job_id, init.master_port, &secret)?),
        _ => None,
    };
    if from != SecretFrom::Given {
        static SAID: std::sync::Once = std::sync::Once::new();
        SAID.call_once(|| {
            eprintln!(
                "shardlab: rank {rank}: {} is not set: rank 0 drew a secret for this run and left it for the other \
                 ranks in a file only this user can read ({}); export one {} for ranks on several machines",
                auth::SECRET_ENV,
                local_secret::describe(&cfg.job_id, init.master_port),
                auth::SECRET_ENV
            )
        });
    }
    let deadline = std::time::Instant::now() + cfg.rendezvous_timeout;
    let mut client = loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match StoreClient::connect(&master, &cfg.job_id, &secret, left) {
            // An earlier run's file, read before this run's rank 0 replaced it: read it again.
            Err(CommError::Auth(_)) if from == SecretFrom::File && std::time::Instant::now() < deadline => {
                secret = local_secret::fetch(&cfg.job_id, init.master_port, deadline, Some(&secret))?;
            }
            r => break r?,
        }
    };
    cfg.secret = Some(secret);
    if client.add(&format!("joined/{rank}"), 1)? > 1 {
        return Err(CommError::Rendezvous(format!("two processes joined as RANK {rank}")));
    }
    Ok((server, client, kept))
}

type SecretKept = Option<local_secret::SecretFile>;

/// The first host of a Slurm node list: `gpu[07-09,12],cpu1` → `gpu07`, `a[1-2]-ib` → `a1-ib`,
/// `n1,n2` → `n1` (what `scontrol show hostnames | head -1` prints). `None` for an empty list.
pub fn first_host(nodelist: &str) -> Option<String> {
    // The first entry: up to a comma outside brackets.
    let mut depth = 0;
    let end = nodelist
        .char_indices()
        .find(|&(_, c)| {
            match c {
                '[' => depth += 1,
                ']' => depth -= 1,
                _ => {}
            }
            c == ',' && depth == 0
        })
        .map_or(nodelist.len(), |(i, _)| i);
    // Each bracket group contributes its first value: `rack[2-3]n[01-04]` → `rack2n01`.
    let mut host = nodelist[..end].trim().to_string();
    while let (Some(a), Some(b)) = (host.find('['), host.find(']')) {
        if b < a {
            break;
        }
        let first = host[a + 1..b].split(',').next().unwrap_or("").split('-').next().unwrap_or("").to_string();
        host = format!("{}{}{}", &host[..a], first, &host[b + 1..]);
    }
    (!host.is_empty()).then_some(host)
}

impl ProcessGroup {
    /// `world_size` ranks as threads of this process: returns one group per rank; move each into
    /// its own thread (see [`crate::launch::spawn`] which does this for you).
    pub fn local_world(world_size: usize, cfg: CommConfig) -> CommResult<Vec<ProcessGroup>> {
        if world_size == 0 {
            return Err(CommError::InvalidArgument("world_size must be at least 1".into()));
        }
        cfg.validate()?;
        let uid = super::subgroup::fresh_uid();
        Ok(local::local_world(world_size)
            .into_iter()
            .enumerate()
            .map(|(r, t)| {
                let host = Arc::new(HostBackend::new(Box::new(t), &cfg));
                let mut pg = ProcessGroup::new(host, Backend::Local, cfg.clone(), (r, world_size), None);
                pg.uid = uid;
                pg
            })
            .collect())
    }

    /// Join a TCP group: rank 0 hosts the store at `master_addr:master_port`, every rank connects
    /// to it, publishes its data address and connects to every other rank.
    pub fn init_tcp(init: &TcpInit, mut cfg: CommConfig) -> CommResult<ProcessGroup> {
        let (rank, n) = (init.rank, init.world_size);
        let (server, mut client, _kept) = join_store(init, &mut cfg)?;
        let ip = client.local_ip()?;
        let t = TcpTransport::connect(rank, n, &mut client, ip, &cfg)?;
        let host = Arc::new(HostBackend::new(Box::new(t), &cfg));
        let local = (init.local_rank, init.local_world_size);
        let mut pg = ProcessGroup::new(host.clone(), Backend::Tcp, cfg, local, server);
        pg.data_ip = Some(ip);
        pg.barrier()?;
        // Every rank is through the rendezvous (and has mapped its peers' shared memory).
        host.group_formed();
        // The store serves nobody from now on.
        if let Some(s) = &pg.store {
            s.close();
        }
        Ok(pg)
    }

    /// Join an NCCL group (lesson 11): the tcp backend's rendezvous (rank 0's store, every
    /// connection authenticated), rank 0's NCCL unique id handed to every rank through it, then
    /// `ncclCommInitRank` on `cuda:LOCAL_RANK` (modulo the GPUs this process sees).
    pub fn init_nccl(init: &TcpInit, mut cfg: CommConfig) -> CommResult<ProcessGroup> {
        let (rank, n) = (init.rank, init.world_size);
        let gpus = crate::device::cuda_devices();
        if gpus == 0 {
            return Err(CommError::InvalidArgument(
                "the nccl backend needs a CUDA device, and libtorch sees none (use the tcp backend on CPUs)".into(),
            ));
        }
        let lib = super::nccl::Lib::get()?;
        if init.local_world_size > gpus {
            return Err(CommError::InvalidArgument(format!(
                "the nccl backend runs one rank per GPU: {} ranks on this machine, {gpus} GPU(s) (NCCL refuses two \
                 ranks on one device; the tcp backend lets ranks share a GPU)",
                init.local_world_size
            )));
        }
        let device = init.local_rank % gpus;
        let (server, mut client, _kept) = join_store(init, &mut cfg)?;
        let id =
            super::nccl::share_unique_id(&mut client, rank, "nccl/id", || lib.unique_id(), cfg.rendezvous_timeout)?;
        let backend = super::nccl::NcclBackend::new(id, rank, n, device, cfg.timeout)?;
        let local = (init.local_rank, init.local_world_size);
        let pg = ProcessGroup::new(Arc::new(backend), Backend::Nccl, cfg, local, server);
        pg.barrier()?;
        if let Some(s) = &pg.store {
            s.close();
        }
        Ok(pg)
    }

    /// Join a TCP group described by the environment, as torchrun sets it: RANK, WORLD_SIZE,
    /// MASTER_ADDR (default 127.0.0.1), MASTER_PORT (default 29500), LOCAL_RANK, LOCAL_WORLD_SIZE.
    ///
    /// Like torchrun, when several ranks share the machine (LOCAL_WORLD_SIZE > 1) libtorch gets one
    /// intra-op thread per rank unless `SHARDLAB_NUM_THREADS` or `OMP_NUM_THREADS` says otherwise.
    pub fn from_env(cfg: CommConfig) -> CommResult<ProcessGroup> {
        let init = TcpInit::from_env()?;
        if let Some(n) = env_num::<i32>("SHARDLAB_NUM_THREADS") {
            tch::set_num_threads(n);
        } else if init.local_world_size > 1 && std::env::var_os("OMP_NUM_THREADS").is_none() {
            tch::set_num_threads(1);
        }
        ProcessGroup::init_tcp(&init, cfg)
    }
}
