//! Multi-node launch (lesson 11): two `launch` processes, as two "nodes" of two ranks each on this
//! machine over loopback, train to bitwise the parameters of one 4-rank job that `train` starts
//! itself (the same ranks, the same ring, the same order of additions); a rank killed under a
//! launcher brings both launchers down promptly with an error; a job on several nodes without a
//! shared secret is refused; Slurm's node lists give the master address.

use shardlab::comm::first_host;
use shardlab::prelude::*;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

const TRAIN: &str = env!("CARGO_BIN_EXE_train");
const LAUNCH: &str = env!("CARGO_BIN_EXE_launch");

fn train_args(save: &Path) -> Vec<String> {
    let a = "--strategy zero3 --steps 3 --n-layer 2 --n-embd 32 --n-head 2 --block-size 16 --vocab-size 64 \
             --batch-size 2 --synthetic-tokens 4000 --json";
    let mut v: Vec<String> = a.split_whitespace().map(String::from).collect();
    v.extend(["--save".into(), save.display().to_string()]);
    v
}

/// The job's ranks are this test's grandchildren: none of this process's spawn variables.
fn clean(c: &mut Command) -> &mut Command {
    for v in ["SHARDLAB_SPAWN_CHILD", "SHARDLAB_LAUNCHER", "RANK", "WORLD_SIZE", "LOCAL_RANK", "SHARDLAB_FAIL_AT"] {
        c.env_remove(v);
    }
    c
}

fn node(rank: usize, port: u16, save: &Path, extra_env: &[(&str, &str)]) -> std::process::Child {
    let mut c = Command::new(LAUNCH);
    clean(&mut c)
        .args(["--nnodes", "2", "--node-rank", &rank.to_string(), "--nproc-per-node", "2"])
        .args(["--master-addr", "127.0.0.1", "--master-port", &port.to_string(), "--grace-s", "10", "--", TRAIN])
        .args(train_args(save))
        .env("SHARDLAB_SECRET", "ab".repeat(32))
        .envs(extra_env.iter().copied())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    c.spawn().expect("start launch")
}

fn weights(p: &Path) -> Vec<f32> {
    let mut t = Tensor::read_safetensors(p).unwrap();
    t.sort_by(|a, b| a.0.cmp(&b.0));
    let all: Vec<Tensor> = t.iter().map(|(_, t)| t.reshape([-1])).collect();
    Vec::<f32>::try_from(&Tensor::cat(&all, 0)).unwrap()
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

#[test]
fn two_launchers_of_two_ranks_train_as_one_four_rank_job() {
    let dir = std::env::temp_dir().join(format!("shardlab-launch-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    // The reference: train starts its 4 rank processes itself.
    let one: PathBuf = dir.join("one.safetensors");
    let o = clean(&mut Command::new(TRAIN)).args(train_args(&one)).args(["--world-size", "4"]).output().unwrap();
    assert!(o.status.success(), "train --world-size 4 failed:\n{}", text(&o));

    // Two nodes of two ranks.
    let two = dir.join("two.safetensors");
    let port = shardlab::launch::free_port().unwrap();
    let t = Instant::now();
    let (a, b) = (node(0, port, &two, &[]), node(1, port, &two, &[]));
    let (a, b) = (a.wait_with_output().unwrap(), b.wait_with_output().unwrap());
    assert!(a.status.success() && b.status.success(), "node 0:\n{}\nnode 1:\n{}", text(&a), text(&b));
    let summary = String::from_utf8_lossy(&a.stdout).lines().filter(|l| l.contains("\"summary\"")).count();
    assert_eq!(summary, 1, "rank 0 (on node 0) reports, once:\n{}", text(&a));
    assert!(!String::from_utf8_lossy(&b.stdout).contains("\"summary\""), "node 1's ranks do not report");
    let (w1, w2) = (weights(&one), weights(&two));
    assert!(w1 == w2, "2 nodes × 2 ranks must train to bitwise the 4-rank job's parameters");
    eprintln!("two launchers: {:?}", t.elapsed());

    // Rank 3 (node 1) is killed before step 2: every rank of both nodes stops, with an error.
    let port = shardlab::launch::free_port().unwrap();
    let t = Instant::now();
    let dead = dir.join("dead.safetensors");
    let fail = [("SHARDLAB_FAIL_AT", "step:3:2")];
    let (a, b) = (node(0, port, &dead, &fail), node(1, port, &dead, &fail));
    let (a, b) = (a.wait_with_output().unwrap(), b.wait_with_output().unwrap());
    assert!(!a.status.success() && !b.status.success(), "both launchers fail:\n{}\n{}", text(&a), text(&b));
    assert!(t.elapsed() < Duration::from_secs(60), "took {:?} to stop", t.elapsed());
    assert!(text(&b).contains("rank 3 failed"), "node 1's launcher names the dead rank:\n{}", text(&b));
    assert!(text(&a).contains("rank 3"), "node 0's ranks say which peer they lost:\n{}", text(&a));
    assert!(!dead.exists(), "a failed job saves no final weights");

    // Several nodes need the secret shared by every machine.
    let o = clean(&mut Command::new(LAUNCH))
        .args(["--nnodes", "2", "--node-rank", "0", "--", TRAIN])
        .env_remove("SHARDLAB_SECRET")
        .output()
        .unwrap();
    assert!(!o.status.success() && text(&o).contains("SHARDLAB_SECRET is not set"), "{}", text(&o));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn slurm_node_lists_give_the_first_host() {
    assert_eq!(first_host("gpu[07-09,12],cpu1").as_deref(), Some("gpu07"));
    assert_eq!(first_host("a[1-2]-ib").as_deref(), Some("a1-ib"));
    assert_eq!(first_host("n1,n2").as_deref(), Some("n1"));
    assert_eq!(first_host("node003").as_deref(), Some("node003"));
    assert_eq!(first_host("rack[2-3]n[01-04]").as_deref(), Some("rack2n01"), "every bracket group: its first value");
    assert_eq!(first_host(""), None);
}

/// Ranks that srun starts itself: the rank, world, local rank and master address from Slurm's
/// variables; this node's task count from SLURM_STEP_TASKS_PER_NODE when `--ntasks-per-node` was
/// not given (SLURM_NTASKS_PER_NODE is then unset, and the world size would be wrong: NCCL
/// refuses it); the master from the step's node list, not the job's.
#[test]
fn srun_started_ranks_read_the_steps_layout() {
    use shardlab::comm::{tasks_on_node, TcpInit};
    use std::collections::BTreeMap;
    assert_eq!(tasks_on_node("2(x3),1", 0), Some(2));
    assert_eq!(tasks_on_node("2(x3),1", 2), Some(2));
    assert_eq!(tasks_on_node("2(x3),1", 3), Some(1));
    assert_eq!(tasks_on_node("2(x3),1", 4), None);
    assert_eq!(tasks_on_node("8", 0), Some(8));
    let init = |vars: &[(&str, &str)]| {
        let m: BTreeMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        TcpInit::from_lookup(&|n| m.get(n).cloned()).unwrap()
    };
    let srun = [
        ("SLURM_PROCID", "7"),
        ("SLURM_NTASKS", "7"),
        ("SLURM_LOCALID", "0"),
        ("SLURM_NODEID", "3"),
        ("SLURM_STEP_TASKS_PER_NODE", "2(x3),1"),
        ("SLURM_STEP_NODELIST", "gpu[03-06]"),
        ("SLURM_JOB_NODELIST", "gpu[01-08]"),
    ];
    let i = init(&srun);
    assert_eq!((i.rank, i.world_size, i.local_rank, i.local_world_size), (7, 7, 0, 1));
    assert_eq!(i.master_addr, "gpu03", "the step's first node, not the job's");
    assert_eq!(i.master_port, 29500);
    let mut on_node_1 = srun.to_vec();
    on_node_1[3] = ("SLURM_NODEID", "1");
    assert_eq!(init(&on_node_1).local_world_size, 2);
    // With --ntasks-per-node, and with the launcher's own variables: those win.
    let per_node = [("SLURM_PROCID", "1"), ("SLURM_NTASKS", "8"), ("SLURM_NTASKS_PER_NODE", "4")];
    assert_eq!(init(&per_node).local_world_size, 4);
    let mut launched = srun.to_vec();
    launched.extend([("LOCAL_WORLD_SIZE", "3"), ("MASTER_ADDR", "10.0.0.1"), ("MASTER_PORT", "1234")]);
    let i = init(&launched);
    assert_eq!((i.local_world_size, i.master_addr.as_str(), i.master_port), (3, "10.0.0.1", 1234));
}

/// What `launch` tells each rank besides its place: GROUP_WORLD_SIZE (the nodes),
/// TORCHELASTIC_RESTART_COUNT (0: it does not restart) and, unless set, OMP_NUM_THREADS (this
/// machine's cores over its ranks), as torchrun sets them.
#[test]
fn launch_sets_torchruns_variables() {
    let dir = std::env::temp_dir().join(format!("shardlab-launch-env-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let script = format!(
        r#"echo "$GROUP_WORLD_SIZE $TORCHELASTIC_RESTART_COUNT $OMP_NUM_THREADS $LOCAL_WORLD_SIZE" > {}/env.$RANK"#,
        dir.display()
    );
    let mut c = Command::new(LAUNCH);
    clean(&mut c).env_remove("OMP_NUM_THREADS").args(["--nproc-per-node", "2", "--", "sh", "-c", &script]);
    let out = c.output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    for r in 0..2 {
        let got = std::fs::read_to_string(dir.join(format!("env.{r}"))).unwrap();
        assert_eq!(got.trim(), format!("1 0 {} 2", (cores / 2).max(1)), "rank {r}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Whether process `pid` is gone (or a zombie nobody reaped: dead all the same).
fn dead(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(s) => s.rsplit(") ").next().is_some_and(|rest| rest.starts_with('Z')),
    }
}

/// Signals, as torchrun handles them: SIGTERM to the launcher reaches every rank (each exits
/// through its own handler) and the launcher exits 128 + 15 with no rank left; SIGKILL to the
/// launcher kills its ranks too (they are started with `PR_SET_PDEATHSIG`); after a rank fails,
/// the others get SIGTERM once the grace period is over (not SIGKILL first), said once.
#[test]
fn the_launcher_forwards_signals_and_leaves_no_rank_behind() {
    let dir = std::env::temp_dir().join(format!("shardlab-launch-signals-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    // Each rank writes its pid, and on SIGTERM a file of its own before it exits 0.
    let script = |d: &Path, fail_rank0: bool| {
        let fail = if fail_rank0 { r#"if [ "$RANK" = 0 ]; then exit 3; fi; "# } else { "" };
        format!(
            r#"echo $$ > {d}/pid.$RANK; {fail}trap 'echo term > {d}/term.$RANK; exit 0' TERM; while true; do sleep 0.05; done"#,
            d = d.display()
        )
    };
    let start = |d: &Path, fail: bool, grace: &str| {
        let mut c = Command::new(LAUNCH);
        clean(&mut c)
            .args(["--nproc-per-node", "2", "--grace-s", grace, "--term-s", "5", "--", "sh", "-c", &script(d, fail)])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        c.spawn().expect("start launch")
    };
    let pids = |d: &Path| -> Vec<i32> {
        let t0 = Instant::now();
        loop {
            let p: Vec<i32> = (0..2)
                .filter_map(|r| std::fs::read_to_string(d.join(format!("pid.{r}"))).ok())
                .filter_map(|s| s.trim().parse().ok())
                .collect();
            if p.len() == 2 {
                return p;
            }
            assert!(t0.elapsed() < Duration::from_secs(20), "the ranks did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    // SIGTERM to the launcher.
    let d = dir.join("term");
    std::fs::create_dir_all(&d).unwrap();
    let l = start(&d, false, "30");
    let ranks = pids(&d);
    unsafe { libc::kill(l.id() as i32, libc::SIGTERM) };
    let out = l.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(128 + 15), "{}", text(&out));
    for r in 0..2 {
        assert!(d.join(format!("term.{r}")).is_file(), "rank {r} got SIGTERM: {}", text(&out));
    }
    assert!(ranks.iter().all(|&p| dead(p)), "no rank outlives the launcher");
    // SIGKILL to the launcher: its ranks die with it.
    let d = dir.join("kill");
    std::fs::create_dir_all(&d).unwrap();
    let mut l = start(&d, false, "30");
    let ranks = pids(&d);
    l.kill().unwrap();
    l.wait().unwrap();
    let t0 = Instant::now();
    while !ranks.iter().all(|&p| dead(p)) && t0.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(ranks.iter().all(|&p| dead(p)), "ranks {ranks:?} outlived their SIGKILLed launcher");
    // Rank 0 fails: rank 1 gets SIGTERM after the grace period and exits through its handler.
    let d = dir.join("fail");
    std::fs::create_dir_all(&d).unwrap();
    let l = start(&d, true, "0.5");
    let out = l.wait_with_output().unwrap();
    let t = text(&out);
    assert_eq!(out.status.code(), Some(3), "the first failure's code: {t}");
    assert!(d.join("term.1").is_file(), "rank 1 got SIGTERM, not SIGKILL: {t}");
    assert_eq!(t.matches("SIGTERM to the").count(), 1, "{t}");
    assert!(!t.contains("killing rank"), "{t}");
    let _ = std::fs::remove_dir_all(&dir);
}
