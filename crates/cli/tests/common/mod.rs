//! Helpers shared by the CLI tests (each test file is its own crate and pulls this in).

#[allow(dead_code)] // only the tests of pages load them
pub mod browser;
pub mod hosts;
pub mod stranger;
pub mod wait;

use std::process::{Command, Output};

/// The `lazarus` binary built for these tests, as a command: the runs a test does not give a
/// directory of their own go under the build's scratch space (`LAZARUS_RUNS_DIR`), not into
/// the working tree.
pub fn lazarus_command() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_lazarus"));
    cmd.env("LAZARUS_RUNS_DIR", runs_dir());
    cmd
}

/// Where the tests' runs without a directory of their own go.
pub fn runs_dir() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("runs")
}

/// Run the `lazarus` binary built for these tests, to its end: a command that runs past
/// [`COMMAND_LIMIT`] is killed and the test fails naming it (a hang is a failure with a name,
/// not a CI run that never ends).
pub fn lazarus(args: &[&str]) -> Output {
    lazarus_within(args, COMMAND_LIMIT)
}

/// [`lazarus`] with another bound: a long job run by hand (the soak at scale's reference run).
pub fn lazarus_within(args: &[&str], limit: std::time::Duration) -> Output {
    let mut cmd = lazarus_command();
    cmd.args(args).env_remove("LAZARUS_STATUS_TOKEN");
    output_limited(cmd, &format!("lazarus {}", args.join(" ")), limit)
}

/// The longest one command of a test may take (the longest, a reference run of a few hundred
/// steps, takes seconds).
pub const COMMAND_LIMIT: std::time::Duration = std::time::Duration::from_secs(600);

/// `cmd`'s output, as [`Command::output`] gives it, within [`COMMAND_LIMIT`].
pub fn output_within(cmd: Command, what: &str) -> Output {
    output_limited(cmd, what, COMMAND_LIMIT)
}

/// `cmd`'s output within `limit`.
pub fn output_limited(cmd: Command, what: &str, limit: std::time::Duration) -> Output {
    match output_or_stderr(cmd, limit) {
        Ok(out) => out,
        Err(err) => panic!("`{what}` ran past {} s (killed). Its stderr:\n{err}", limit.as_secs()),
    }
}

/// `cmd`'s output within `limit`, or (killed past it) what it wrote to stderr.
pub fn output_or_stderr(mut cmd: Command, limit: std::time::Duration) -> Result<Output, String> {
    use std::io::Read;
    use std::process::Stdio;
    let mut child = cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("run lazarus");
    let read = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            let _ = r.read_to_end(&mut buf);
            buf
        })
    };
    let (out, err) = (read(Box::new(child.stdout.take().unwrap())), read(Box::new(child.stderr.take().unwrap())));
    let until = std::time::Instant::now() + limit;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if std::time::Instant::now() >= until {
            let _ = child.kill();
            let _ = child.wait();
            return Err(String::from_utf8_lossy(&err.join().unwrap()).into_owned());
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    Ok(Output { status, stdout: out.join().unwrap(), stderr: err.join().unwrap() })
}

/// `lazarus status --controller ADDR ARGS…` proving `token` (as the controller printed it).
#[allow(dead_code)] // not every test file asks a controller
pub fn status_with_token(addr: &str, token: &str, args: &[&str]) -> Output {
    lazarus_command().args(["status", "--controller", addr]).args(args).env("LAZARUS_STATUS_TOKEN", token).output().expect("run lazarus")
}

/// A fresh, empty scratch directory for one test (the process id keeps test binaries apart),
/// removed when the test is done with it — kept when the test fails, to be looked at.
#[allow(dead_code)] // not every test file writes files
pub fn dir(name: &str) -> Scratch {
    let d = std::env::temp_dir().join(format!("lazarus-cli-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    Scratch(d)
}

/// Files `names` in `d`, each as its path and as text for a flag:
/// `let [(path, log_s), (ck, ck_s)] = files(&d, ["log.jsonl", "ck"]);`.
#[allow(dead_code)] // not every test file writes files
pub fn files<const N: usize>(d: &std::path::Path, names: [&str; N]) -> [(std::path::PathBuf, String); N] {
    names.map(|name| {
        let path = d.join(name);
        let text = path.to_str().expect("a UTF-8 path").to_string();
        (path, text)
    })
}

/// File `name` in `d` written with `text`; its path as text, for a flag.
#[allow(dead_code)] // not every test file writes files
pub fn written(d: &std::path::Path, name: &str, text: &str) -> String {
    let path = d.join(name);
    std::fs::write(&path, text).unwrap();
    path.to_str().expect("a UTF-8 path").to_string()
}

/// A test's scratch directory ([`dir`]): a path, removed on drop unless the test panicked.
pub struct Scratch(std::path::PathBuf);

impl std::ops::Deref for Scratch {
    type Target = std::path::Path;
    fn deref(&self) -> &std::path::Path {
        &self.0
    }
}

impl AsRef<std::path::Path> for Scratch {
    fn as_ref(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// DeepSeek-V3's blocks on top of [`tiny_model`]: a dense first block, latent attention with a
/// query latent (keys and values 8, queries 12, rotary 4), a sigmoid router limited to the top
/// one of two expert groups and scaled by 2.5, a shared expert, the loss-free balancing's
/// routing bias.
#[allow(dead_code)] // not every test file trains DeepSeek-V3's blocks
pub const DEEPSEEK_V3: &[&str] = &[
    "--arch",
    "deepseek-moe",
    "--dense-first",
    "1",
    "--kv-lora-rank",
    "8",
    "--q-lora-rank",
    "12",
    "--rope-head-dim",
    "4",
    "--expert-groups",
    "2",
    "--top-groups",
    "1",
    "--routed-scaling",
    "2.5",
    "--balance",
    "bias",
    "--bias-update-rate",
    "0.01",
];

/// Flags of a model small enough for tests (2 blocks of d_model 32, 4 experts of d_ff 32,
/// 16-token sequences, a 20 kB synthetic corpus) with `batch` sequences a step.
#[allow(dead_code)] // not every test file trains
pub fn tiny_model(batch: &'static str) -> [&'static str; 16] {
    [
        "--d-model",
        "32",
        "--layers",
        "2",
        "--heads",
        "2",
        "--experts",
        "4",
        "--d-ff",
        "32",
        "--seq-len",
        "16",
        "--batch-size",
        batch,
        "--synthetic-bytes",
        "20000",
    ]
}

/// The environment that makes every step of a job's workers take at least `ms` milliseconds
/// (`LAZARUS_FAULT=pace:MS`): a test that must act while a job runs (a join, a kill, a drain)
/// gives the job a least length in time, so that a fast machine does not end it first. A slow
/// machine only makes it longer, and the waits follow its progress.
#[allow(dead_code)]
pub fn paced(ms: u32) -> [(&'static str, &'static str); 1] {
    [("LAZARUS_FAULT", String::leak(format!("pace:{ms}")))]
}

/// Start `lazarus train --workers N …` (`args`, with `env` set); returns it and its stderr
/// lines as they come (stdout is piped too: the summary is small).
#[allow(dead_code)] // only the tests of worker processes start them
pub fn spawn_lazarus(args: &[&str], env: &[(&str, &str)]) -> (std::process::Child, std::sync::mpsc::Receiver<String>) {
    use std::process::Stdio;
    let mut cmd = lazarus_command();
    cmd.args(args).envs(env.iter().copied()).stdout(Stdio::piped()).stderr(Stdio::piped());
    // A test run started in the background by a non-interactive shell inherits SIGINT and
    // SIGQUIT ignored; the tests that send them need the default disposition back.
    use std::os::unix::process::CommandExt;
    // SAFETY: only async-signal-safe calls (signal) between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            libc::signal(libc::SIGINT, libc::SIG_DFL);
            libc::signal(libc::SIGQUIT, libc::SIG_DFL);
            Ok(())
        });
    }
    let mut child = cmd.spawn().unwrap();
    let lines = stderr_lines(&mut child);
    (child, lines)
}

/// Run `lazarus ARGS`, a job of `workers.0` worker processes whose `--json-log` is `log`;
/// SIGKILL worker `workers.1` from outside once `after` steps are logged, and wait for the job
/// to succeed all the same (`what` names it if it does not). Its lines.
#[allow(dead_code)] // only the tests of worker processes kill them
pub fn run_killing_one(args: &[&str], log: &std::path::Path, workers: (usize, usize), after: usize, what: &str) -> Vec<String> {
    let (mut child, lines) = spawn_lazarus(args, &[]);
    let pids = worker_pids(&lines, workers.0, |_| {});
    wait_for_steps(log, after);
    signal(pids[workers.1], libc::SIGKILL);
    wait::job_success(&mut child, &lines, log, what)
}

/// The lines of a child's piped stderr, as they come.
pub fn stderr_lines(child: &mut std::process::Child) -> std::sync::mpsc::Receiver<String> {
    use std::io::{BufRead, BufReader};
    let (tx, rx) = std::sync::mpsc::channel();
    let stderr = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    rx
}

/// Read `lines` until each of `n` workers has said `worker R: pid P ready`; their pids by rank.
/// Every line read is also handed to `seen`.
#[allow(dead_code)] // only the tests of worker processes start them
pub fn worker_pids(lines: &std::sync::mpsc::Receiver<String>, n: usize, mut seen: impl FnMut(&str)) -> Vec<i32> {
    let mut pids = vec![0i32; n];
    let mut read = Vec::new();
    while pids.contains(&0) {
        let what = format!("workers {:?} to start", (0..n).filter(|&r| pids[r] == 0).collect::<Vec<_>>());
        let line = wait::line(lines, what, std::time::Duration::from_secs(120), &mut read, |_| true);
        if let Some(rest) = line.strip_prefix("worker ") {
            if let (Some(rank), Some(pid)) = (rest.split(':').next(), rest.split("pid ").nth(1)) {
                pids[rank.parse::<usize>().unwrap()] = pid.split_whitespace().next().unwrap().parse().unwrap();
            }
        }
        seen(&line);
    }
    pids
}

/// The expert set of each worker in the `placement L0: w0[..] w1[..] …` line of a run's stderr.
#[allow(dead_code)] // only the tests that pick victims by placement read it
pub fn placement_sets(stderr: &str) -> Vec<String> {
    let line = stderr.lines().find(|l| l.starts_with("placement L0: ")).expect("the placement is shown");
    line["placement L0: ".len()..].split_whitespace().map(|w| w[w.find('[').unwrap()..].to_string()).collect()
}

/// Two workers that hold exactly the same experts (of layer 0): killing both loses every
/// replica of those.
#[allow(dead_code)]
pub fn twin_holders(stderr: &str) -> (usize, usize) {
    let sets = placement_sets(stderr);
    for a in 0..sets.len() {
        for b in a + 1..sets.len() {
            if sets[a] == sets[b] {
                return (a, b);
            }
        }
    }
    panic!("no two workers hold the same experts: {sets:?}");
}

/// A worker whose expert set no other worker has (with one slot a worker: the lone holder of
/// its expert).
#[allow(dead_code)]
pub fn lone_holder(stderr: &str) -> usize {
    let sets = placement_sets(stderr);
    (0..sets.len()).find(|&w| sets.iter().filter(|s| **s == sets[w]).count() == 1).expect("a lone holder")
}

/// The step lines (step, loss) and the reconfiguration lines of a `--json-log`.
#[allow(dead_code)] // only the tests of worker processes read logs this way
pub fn log(path: &std::path::Path) -> (Vec<(u64, f64)>, Vec<serde_json::Value>) {
    let mut steps = Vec::new();
    let mut reconf = Vec::new();
    // Read while the job may be writing it: whole lines only.
    let text = std::fs::read_to_string(path).unwrap_or_default();
    for line in text[..text.rfind('\n').map_or(0, |i| i + 1)].lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        if v["event"] == "reconfiguration" {
            reconf.push(v);
        } else if v["event"].is_string() {
            continue; // another record (a rebalance weighed)
        } else {
            steps.push((v["step"].as_u64().unwrap(), v["loss"].as_f64().unwrap()));
        }
    }
    (steps, reconf)
}

/// Wait until the `--json-log` at `path` has `n` lines, for as long as it grows
/// ([`wait::steps`]).
#[allow(dead_code)]
pub fn wait_for_steps(path: &std::path::Path, n: usize) {
    wait::steps(path, n)
}

/// Send `sig` to `pid`.
#[allow(dead_code)]
pub fn signal(pid: i32, sig: i32) {
    // SAFETY: a signal to a process this test started.
    assert_eq!(unsafe { libc::kill(pid, sig) }, 0);
}

/// Whether process `pid` still runs (a zombie waiting to be reaped does not).
#[allow(dead_code)]
pub fn alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            stat.rsplit(')').next().and_then(|rest| rest.split_whitespace().next()).is_some_and(|state| state != "Z" && state != "X")
        }
        Err(_) => false,
    }
}

/// The same run (the tiny model, batch 8) in one process: its losses.
#[allow(dead_code)]
pub fn uninterrupted(steps: &str, d: &std::path::Path) -> Vec<f64> {
    uninterrupted_with_cursor(steps, d).0
}

/// The same run in one process: its losses, and the data cursor of its final checkpoint.
#[allow(dead_code)]
pub fn uninterrupted_with_cursor(steps: &str, d: &std::path::Path) -> (Vec<f64>, serde_json::Value) {
    let path = d.join("reference.jsonl");
    let ck = d.join("reference-ck");
    let mut args = vec!["train", "--steps", steps, "--json-log", path.to_str().unwrap(), "--checkpoint-dir", ck.to_str().unwrap()];
    args.extend(tiny_model("8"));
    let out = lazarus(&args);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    (log(&path).0.into_iter().map(|(_, l)| l).collect(), cursor(&ck))
}

/// The data cursor of the newest checkpoint in `ck`: where the next batch starts.
#[allow(dead_code)]
pub fn cursor(ck: &std::path::Path) -> serde_json::Value {
    let latest = std::fs::read_to_string(ck.join("latest")).unwrap();
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(ck.join(latest.trim()).join("manifest.json")).unwrap()).unwrap();
    manifest["extra"]["cursor"].clone()
}

/// Every step logged exactly once, each loss within 1e-4 (relative) of the uninterrupted run's.
#[allow(dead_code)]
pub fn assert_same_losses(got: &[(u64, f64)], want: &[f64], what: &str) {
    let numbers: Vec<u64> = got.iter().map(|(s, _)| *s).collect();
    if let Some(i) = (0..numbers.len().max(want.len())).find(|&i| numbers.get(i) != Some(&(i as u64 + 1))) {
        let near = &numbers[i.saturating_sub(3)..(i + 3).min(numbers.len())];
        panic!(
            "{what}: every step logged exactly once: {} steps logged of {}; where step {} should be: {near:?}",
            numbers.len(),
            want.len(),
            i + 1
        );
    }
    for ((s, a), b) in got.iter().zip(want) {
        assert!((a - b).abs() <= 1e-4 * b.abs(), "{what}: step {s} loss {a} vs uninterrupted {b}");
    }
}

/// The tensors of the safetensors file at `path` split into `parts` files' contents (their
/// names and bytes), the names sorted — a sharded checkpoint, as transformers writes past a
/// size.
#[allow(dead_code)]
pub fn safetensors_split(path: &std::path::Path, parts: usize) -> (Vec<Vec<String>>, Vec<Vec<u8>>) {
    let bytes = std::fs::read(path).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut names: Vec<String> = file.names().into_iter().map(String::from).collect();
    names.sort();
    let chunk = names.len().div_ceil(parts);
    let groups: Vec<Vec<String>> = names.chunks(chunk).map(|c| c.to_vec()).collect();
    let contents = groups
        .iter()
        .map(|group| {
            let views: Vec<(String, safetensors::tensor::TensorView)> =
                group.iter().map(|n| (n.clone(), file.tensor(n).unwrap())).collect();
            safetensors::serialize(views, None).unwrap()
        })
        .collect();
    (groups, contents)
}

/// A limit set on a process before it runs, as a batch system (or a full disk) would.
#[allow(dead_code)]
#[derive(Clone, Copy)]
pub enum Limit {
    /// `ulimit -v`: bytes of address space.
    AddressSpace(u64),
    /// `ulimit -f`: bytes a file may grow to; a write past it fails with EFBIG, as one on a
    /// full disk fails (SIGXFSZ is ignored).
    FileSize(u64),
}

/// `lazarus args` run to its end (within [`output_within`]'s bound) under `limit`.
#[allow(dead_code)]
pub fn lazarus_limited(args: &[&str], limit: Limit, what: &str) -> Output {
    use std::os::unix::process::CommandExt;
    let mut cmd = lazarus_command();
    cmd.args(args);
    // SAFETY: signal and setrlimit are async-signal-safe; nothing else runs before exec.
    unsafe {
        cmd.pre_exec(move || {
            let (resource, bytes) = match limit {
                Limit::AddressSpace(b) => (libc::RLIMIT_AS, b),
                Limit::FileSize(b) => {
                    libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
                    (libc::RLIMIT_FSIZE, b)
                }
            };
            let r = libc::rlimit { rlim_cur: bytes, rlim_max: bytes };
            if libc::setrlimit(resource, &r) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    output_within(cmd, what)
}

/// The final checkpoint in `ck` resumes in the single-process trainer, which trains on to step
/// `steps` (two more than the checkpoint's) and logs those two.
#[allow(dead_code)] // only the tests of worker processes resume their checkpoints
pub fn resumes_in_one_process(ck: &std::path::Path, steps: &str, d: &std::path::Path) {
    let more = d.join("more.jsonl");
    let out =
        lazarus(&["train", "--resume", "--steps", steps, "--checkpoint-dir", ck.to_str().unwrap(), "--json-log", more.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(log(&more).0.len(), 2, "the resumed run logs the steps after the checkpoint");
}
