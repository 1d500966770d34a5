//! The node agents `train --workers N --gpus-per-node G` starts on this host, on loopback — and,
//! with a node schedule (a failure trace replayed), the ones it kills and starts on schedule.

use lazarus_setting::Setting;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::AgentsSpec;
use lazarus_agent::launcher::die_with_parent;
use lazarus_protocol::secret_hex;
use lazarus_protocol::ControlError;

/// One change of a replayed schedule: node `node` comes (`add`) or goes, `at` after the start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeChange {
    pub at: Duration,
    pub node: String,
    pub add: bool,
}

/// Nodes coming and going on this host's local agents (a failure trace, time-scaled): the
/// nodes present at the start, in the order of the job's first agents, and the changes after.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeSchedule {
    pub initial: Vec<String>,
    pub changes: Vec<NodeChange>,
    /// A node that goes is given notice (SIGTERM: drained) instead of killed (SIGKILL).
    pub notice: bool,
}

/// Agent processes started on this host (`train --workers N --gpus-per-node G`), by node name.
pub(super) struct LocalAgents {
    children: Vec<(String, std::process::Child)>,
    exe: std::path::PathBuf,
    controller: SocketAddr,
    gpus: usize,
    secret: u128,
    command_line: AgentCommandLine,
}

/// The arguments that start an agent of `gpus` GPUs for the controller at the address, with no
/// grace for a lost controller (local agents go with the process that runs their controller):
/// the front end's (the CLI's `agent` subcommand and its flags).
pub type AgentCommandLine = fn(SocketAddr, usize) -> Vec<String>;

impl LocalAgents {
    pub(super) fn reap_within(&mut self, within: Duration) {
        let until = Instant::now() + within;
        for (_, c) in &mut self.children {
            while matches!(c.try_wait(), Ok(None)) && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(10));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Start node `name`'s agent.
    fn start(&mut self, name: &str) -> Result<(), ControlError> {
        let mut cmd = std::process::Command::new(&self.exe);
        // Local agents go with the process that runs their controller: nothing to wait for.
        cmd.args((self.command_line)(self.controller, self.gpus))
            .env("LAZARUS_SECRET", secret_hex(self.secret))
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::inherit());
        die_with_parent(&mut cmd);
        let child = cmd.spawn().map_err(|e| ControlError::io(format!("starting the agent of node {name}"), e))?;
        self.children.push((name.to_string(), child));
        Ok(())
    }

    /// Node `name` goes: its agent is killed, or given notice. False if it runs no agent.
    fn remove(&mut self, name: &str, notice: bool) -> bool {
        let Some(i) = self.children.iter().position(|(n, c)| n == name && c.id() > 0) else { return false };
        let (_, child) = &mut self.children[i];
        if matches!(child.try_wait(), Ok(Some(_))) {
            return false;
        }
        // SAFETY: a signal to a child this process started and has not reaped.
        unsafe {
            libc::kill(child.id() as i32, if notice { libc::SIGTERM } else { libc::SIGKILL });
        }
        if !notice {
            let _ = child.wait();
            self.children.remove(i);
        } else {
            // It leaves on its own once drained; its name is free for a later add.
            self.children[i].0 = format!("{name} (leaving)");
        }
        true
    }
}

impl Drop for LocalAgents {
    fn drop(&mut self) {
        for (_, c) in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

pub(super) fn start_local_agents(a: &AgentsSpec, controller: SocketAddr) -> Result<LocalAgents, ControlError> {
    let exe = std::env::current_exe().map_err(|e| ControlError::io("locating the lazarus binary", e))?;
    let mut agents = LocalAgents {
        children: Vec::with_capacity(a.local_agents),
        exe,
        controller,
        gpus: a.gpus_per_node,
        secret: a.secret,
        command_line: a.agent_command_line,
    };
    let names: Vec<String> = match &a.schedule {
        Some(s) => s.initial.clone(),
        None => (0..a.local_agents).map(|i| format!("n{i}")).collect(),
    };
    if names.len() != a.local_agents {
        return Err(ControlError::invalid(
            Setting::Replay,
            format!(
                "{} nodes at the trace's start, but {} / {} is {}",
                names.len(),
                Setting::Workers,
                Setting::GpusPerNode,
                a.local_agents
            ),
        ));
    }
    for name in &names {
        agents.start(name)?;
    }
    Ok(agents)
}

/// Replays `schedule` on `agents` from now until it ends or `stop` is set: kills (or gives notice
/// to) the agents of nodes that go, starts agents for nodes that come.
pub(super) fn replay(agents: Arc<Mutex<LocalAgents>>, schedule: NodeSchedule, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let begun = Instant::now();
        for change in schedule.changes {
            let due = begun + change.at;
            while Instant::now() < due {
                if stop.load(Ordering::Relaxed) {
                    return;
                }
                std::thread::sleep((due - Instant::now()).min(Duration::from_millis(50)));
            }
            if stop.load(Ordering::Relaxed) {
                return;
            }
            let mut agents = agents.lock().unwrap_or_else(|e| e.into_inner());
            let at = change.at.as_secs_f64();
            if change.add {
                match agents.start(&change.node) {
                    Ok(()) => tracing::info!("replay {at:.1} s: node {} comes (a new agent)", change.node),
                    Err(e) => tracing::warn!("replay {at:.1} s: node {} could not start: {e}", change.node),
                }
            } else if agents.remove(&change.node, schedule.notice) {
                let how = if schedule.notice { "given notice (SIGTERM)" } else { "killed (SIGKILL)" };
                tracing::info!("replay {at:.1} s: node {} goes: its agent {how}", change.node);
            }
        }
        // The agents this thread started die with it (PR_SET_PDEATHSIG is the parent *thread*'s
        // death): it lives until the job is over.
        while !stop.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(50));
        }
    })
}
