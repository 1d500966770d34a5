//! The Slurm recipe (`deploy/slurm/lazarus.sbatch`) against a real Slurm: Debian's `slurm-wlm`
//! brought up as a one-node cluster in a scratch directory (`deploy/slurm/local-cluster.sh`).
//! `sbatch` starts the controller and, through `srun`, two agents; one agent is SIGKILLed from
//! outside; its task starts it again and the new agent rejoins the running job, which completes
//! every step once with the losses of an uninterrupted run, and Slurm records the job as
//! completed. Skipped, saying why, without root or without Slurm (`.ci/run` installs it).

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::{assert_same_losses, dir, log, signal, uninterrupted, wait_for_steps};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// A one-node Slurm cluster under a directory; stopped when dropped.
struct Cluster {
    dir: PathBuf,
    conf: String,
}

impl Cluster {
    /// Why there can be none here, if there cannot.
    fn unavailable() -> Option<String> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return Some("a local Slurm cluster needs root".into());
        }
        ["munged", "slurmctld", "slurmd", "sbatch"]
            .iter()
            .find(|t| !Command::new("sh").args(["-c", &format!("command -v {t}")]).output().is_ok_and(|o| o.status.success()))
            .map(|t| format!("{t} not found (apt-get install slurm-wlm)"))
    }

    fn start(dir: &Path) -> Cluster {
        let out = Command::new("bash").arg(repo().join("deploy/slurm/local-cluster.sh")).arg("start").arg(dir).output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        let conf = text.lines().find_map(|l| l.strip_prefix("export SLURM_CONF=")).map(str::to_string);
        let cluster = Cluster { dir: dir.to_path_buf(), conf: conf.unwrap_or_default() };
        assert!(out.status.success() && !cluster.conf.is_empty(), "{}", String::from_utf8_lossy(&out.stderr));
        cluster
    }

    fn command(&self, program: &str) -> Command {
        let mut c = Command::new(program);
        c.env("SLURM_CONF", &self.conf);
        c
    }

    /// What `scontrol show job ID` says of its state (empty once Slurm forgot it).
    fn job_state(&self, id: &str) -> String {
        let out = self.command("scontrol").args(["show", "job", id]).output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        text.split_whitespace().find_map(|w| w.strip_prefix("JobState=")).unwrap_or_default().to_string()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = Command::new("bash").arg(repo().join("deploy/slurm/local-cluster.sh")).arg("stop").arg(&self.dir).status();
    }
}

/// The pids of `lazarus agent` processes that read `secret`.
fn agents_of(secret: &Path) -> Vec<i32> {
    let secret = secret.to_str().unwrap();
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let args: Vec<&[u8]> = cmdline.split(|&b| b == 0).collect();
            args.get(1) == Some(&&b"agent"[..]) && args.contains(&secret.as_bytes())
        })
        .collect()
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

#[test]
fn the_slurm_batch_script_runs_a_job_whose_killed_agent_is_restarted_and_rejoins() {
    if let Some(why) = Cluster::unavailable() {
        eprintln!("skipped: {why}");
        return;
    }
    let d = dir("slurm");
    let steps = "300";
    let want = uninterrupted(steps, &d);
    let cluster = Cluster::start(&d.join("cluster"));
    let (path, files, out) = (d.join("log.jsonl"), d.join("files"), d.join("job.out"));
    let mut sbatch = cluster.command("sbatch");
    sbatch
        .current_dir(&d)
        .env("LAZARUS", env!("CARGO_BIN_EXE_lazarus"))
        .env("LAZARUS_PORT", free_port().to_string())
        .env("LAZARUS_DIR", &files)
        // Paced (every step 10 ms or more), the tiny job's 300 steps take 3 s or more on any
        // machine: its agent comes back while it runs.
        .env("LAZARUS_RESTART_DELAY", "0.1")
        .env("LAZARUS_FAULT", "pace:10")
        .args(["--parsable", "--ntasks=2", "--ntasks-per-node=2", "--output", out.to_str().unwrap()])
        .arg(repo().join("deploy/slurm/lazarus.sbatch"))
        .args(common::tiny_model("8"))
        .args(["--steps", steps, "--json-log", path.to_str().unwrap(), "--lease", "0.5", "--join-wait", "0.2", "--rebalance-every", "0"]);
    let submitted = sbatch.output().unwrap();
    assert!(submitted.status.success(), "{}", String::from_utf8_lossy(&submitted.stderr));
    let id = String::from_utf8_lossy(&submitted.stdout).trim().split(';').next().unwrap().to_string();
    let job_out = || std::fs::read_to_string(&out).unwrap_or_default();

    // Two agents, started by srun; one is killed once the job is under way.
    wait_for_steps(&path, 40);
    let agents = agents_of(&files.join("job.secret"));
    assert_eq!(agents.len(), 2, "two agents run: {}", job_out());
    signal(agents[1], libc::SIGKILL);

    let deadline = Instant::now() + Duration::from_secs(180);
    while cluster.command("squeue").args(["-h", "-j", &id]).output().is_ok_and(|o| !o.stdout.is_empty()) {
        assert!(Instant::now() < deadline, "the job did not end: {}", job_out());
        std::thread::sleep(Duration::from_millis(200));
    }
    let text = job_out();
    let state = cluster.job_state(&id);
    assert!(state.is_empty() || state == "COMPLETED", "job {id} {state}: {text}");
    assert!(text.contains("starting it again (1 of 10)") && text.contains("controller exited with 0"), "{text}");
    let (got, records) = log(&path);
    assert_same_losses(&got, &want, "through a killed agent restarted by its Slurm task");
    let causes: Vec<&str> = records.iter().filter_map(|r| r["cause"].as_str()).collect();
    assert!(causes.first() == Some(&"reconfigure") && causes.contains(&"join"), "lost, then taken back in: {causes:?}");
    drop(cluster);
}
