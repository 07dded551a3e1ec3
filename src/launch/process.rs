//! Ranks as processes. [`spawn_with`](super::spawn_with) with `Launch::Processes` starts this
//! executable again once per rank and collects each child's result (`run_processes`); in such a
//! child, the same call runs that one rank and writes its result for the parent (`run_child`); in
//! a rank that another launcher started (the `launch` bin, torchrun, srun), it joins that
//! launcher's job and runs this process's rank only (`run_external`).

use super::{
    collect, run_rank, set_threads, tcp_port, with_secret, LaunchError, SpawnOptions, ENV_CHILD, ENV_CONFIG,
    ENV_LAUNCHER, ENV_RESULT,
};
use crate::comm::auth::SECRET_ENV;
use crate::comm::{Backend, CommConfig, ProcessGroup, TcpInit};
use serde::{de::DeserializeOwned, Deserialize, Serialize};
use std::os::unix::process::ExitStatusExt;
use std::time::{Duration, Instant};

#[derive(Serialize, Deserialize)]
enum ChildOutcome<R> {
    Ok(R),
    Err(String),
}

pub(super) fn run_child<R, F>(call: usize, target: &str, opts: &SpawnOptions, f: F) -> Result<Vec<R>, LaunchError>
where
    R: Serialize + DeserializeOwned,
    F: Fn(&ProcessGroup) -> anyhow::Result<R>,
{
    if opts.child_args.is_none() && target != call.to_string() {
        eprintln!("shardlab: spawn call #{call} reached in a child of spawn call #{target}; put process spawns before other spawns");
        std::process::exit(3);
    }
    let result_path = std::env::var(ENV_RESULT).unwrap_or_default();
    let write = |s: String| {
        let _ = std::fs::write(&result_path, s);
    };
    {
        let path = result_path.clone();
        let prev = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let out: ChildOutcome<()> = ChildOutcome::Err(format!("panicked: {info}"));
            let _ = std::fs::write(&path, serde_json::to_string(&out).unwrap_or_default());
            prev(info);
        }));
    }
    let cfg: CommConfig = std::env::var(ENV_CONFIG)
        .ok()
        .and_then(|s| serde_json::from_str(&s).ok())
        .unwrap_or_else(|| opts.config.clone());
    let outcome = TcpInit::from_env().and_then(|init| {
        set_threads(opts, init.local_world_size);
        match opts.backend {
            Backend::Nccl => ProcessGroup::init_nccl(&init, cfg),
            _ => ProcessGroup::init_tcp(&init, cfg),
        }
    });
    let outcome = match outcome {
        Err(e) => ChildOutcome::Err(e.to_string()),
        Ok(pg) => {
            let r = run_rank(&pg, &f);
            drop(pg);
            match r {
                Ok(v) => ChildOutcome::Ok(v),
                Err(e) => ChildOutcome::Err(e),
            }
        }
    };
    let failed = matches!(outcome, ChildOutcome::Err(_));
    write(serde_json::to_string(&outcome).unwrap_or_else(|e| format!("{{\"Err\":\"cannot serialise result: {e}\"}}")));
    std::process::exit(if failed { 1 } else { 0 });
}

/// One rank of a job started by another launcher ([`external_launch`](super::external_launch)):
/// join the group the environment describes and run `f` for this rank only. The result holds this
/// rank's value alone.
pub(super) fn run_external<R, F>(call: usize, opts: &SpawnOptions, f: F) -> Result<Vec<R>, LaunchError>
where
    F: Fn(&ProcessGroup) -> anyhow::Result<R>,
{
    let init = TcpInit::from_env().map_err(|e| LaunchError::one(e.to_string()))?;
    let me = init.rank;
    let err = |m: String| LaunchError { failures: vec![(me, m)] };
    if call > 0 {
        return Err(err(format!(
            "this process was started by a launcher ({ENV_LAUNCHER} or torchrun) as one rank of one job, \
             but it is starting a second job (spawn call #{call}): run one job per launch"
        )));
    }
    if opts.backend == Backend::Local {
        return Err(err(
            "started by a launcher, the ranks are processes: use the tcp or nccl backend, not local".into()
        ));
    }
    if init.world_size != opts.world_size {
        return Err(err(format!(
            "the launcher started WORLD_SIZE={} ranks, but this job asks for {}",
            init.world_size, opts.world_size
        )));
    }
    set_threads(opts, init.local_world_size);
    let pg = match opts.backend {
        Backend::Nccl => ProcessGroup::init_nccl(&init, opts.config.clone()),
        _ => ProcessGroup::init_tcp(&init, opts.config.clone()),
    }
    .map_err(|e| err(e.to_string()))?;
    let r = run_rank(&pg, &f);
    drop(pg);
    r.map(|v| vec![v]).map_err(err)
}

pub(super) fn run_processes<R: DeserializeOwned>(call: usize, opts: &SpawnOptions) -> Result<Vec<R>, LaunchError> {
    let n = opts.world_size;
    let exe = std::env::current_exe().map_err(|e| LaunchError::one(format!("cannot find own executable: {e}")))?;
    let port = tcp_port(opts)?;
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    let job = format!("spawn-{}-{nanos}-{port}-{call}", std::process::id());
    let dir = std::env::temp_dir().join(format!("shardlab-{job}"));
    std::fs::create_dir_all(&dir).map_err(|e| LaunchError::one(format!("temp dir: {e}")))?;
    let cfg = CommConfig { job_id: job.clone(), ..with_secret(&opts.config)? };
    let cfg_json = serde_json::to_string(&cfg).expect("config serialises");
    let secret_hex = cfg.secret.as_ref().map(|s| s.to_hex()).unwrap_or_default();
    let mut children = Vec::new();
    for r in 0..n {
        let res = dir.join(format!("rank{r}.json"));
        let mut cmd = std::process::Command::new(&exe);
        match &opts.child_args {
            Some(a) => cmd.args(a),
            None => cmd.args(std::env::args_os().skip(1)),
        };
        // SAFETY: prctl between fork and exec (async-signal-safe): the rank gets SIGKILL when this
        // thread — which waits for it below — or its process dies, so no rank outlives its driver.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut cmd, || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd
            .env(ENV_CHILD, call.to_string())
            .env(ENV_RESULT, &res)
            .env(ENV_CONFIG, &cfg_json)
            .env(SECRET_ENV, &secret_hex)
            .envs(opts.env.iter().map(|(k, v)| (k, v)))
            .env("RANK", r.to_string())
            .env("WORLD_SIZE", n.to_string())
            .env("LOCAL_RANK", r.to_string())
            .env("LOCAL_WORLD_SIZE", n.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .stdin(std::process::Stdio::null())
            .spawn();
        match child {
            Ok(c) => children.push((c, res)),
            Err(e) => {
                for (mut c, _) in children {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                return Err(LaunchError::one(format!("cannot start rank {r}: {e}")));
            }
        }
    }
    // Wait for all; once one failed, give the others `grace` to fail on their own, then kill them.
    let mut status: Vec<Option<std::process::ExitStatus>> = vec![None; n];
    let mut first_failure: Option<Instant> = None;
    let mut killed = vec![false; n];
    while status.iter().any(|s| s.is_none()) {
        for (r, (c, _)) in children.iter_mut().enumerate() {
            if status[r].is_none() {
                match c.try_wait() {
                    Ok(Some(s)) => {
                        if !s.success() && first_failure.is_none() {
                            first_failure = Some(Instant::now());
                        }
                        status[r] = Some(s);
                    }
                    Ok(None) => {}
                    // The child cannot be waited for (already reaped elsewhere?): count it as failed
                    // rather than waiting for ever.
                    Err(_) => {
                        status[r] = Some(std::process::ExitStatus::from_raw(1 << 8));
                        first_failure.get_or_insert_with(Instant::now);
                    }
                }
            }
        }
        if let Some(t) = first_failure {
            if t.elapsed() > opts.grace {
                for (r, (c, _)) in children.iter_mut().enumerate() {
                    if status[r].is_none() {
                        let _ = c.kill();
                        killed[r] = true;
                    }
                }
            }
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let results = children
        .iter()
        .enumerate()
        .map(|(r, (_, path))| {
            let text = std::fs::read_to_string(path).ok();
            let parsed = text.as_deref().and_then(|t| serde_json::from_str::<ChildOutcome<R>>(t).ok());
            match (parsed, status[r]) {
                (Some(ChildOutcome::Ok(v)), Some(s)) if s.success() => Ok(v),
                (Some(ChildOutcome::Err(m)), _) => Err(m),
                (_, _) if killed[r] => {
                    Err(format!("killed after another rank failed and this one did not stop within {:?}", opts.grace))
                }
                (_, Some(s)) => Err(format!("process exited with {s} without reporting a result")),
                (_, None) => Err("process status unknown".into()),
            }
        })
        .collect();
    let _ = std::fs::remove_dir_all(&dir);
    collect(results)
}
