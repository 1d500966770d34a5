//! What the launcher and its worker processes say to each other: one JSON object per line.
//!
//! The launcher writes a [`WorkerSpec`] to the worker's stdin; the worker binds an ephemeral
//! loopback port and answers [`WorkerEvent::Listening`]; the launcher sends
//! [`LauncherMessage::Addrs`] with every rank's address; the worker connects to every peer,
//! answers [`WorkerEvent::Ready`] and then reports on stdout until [`WorkerEvent::Done`] or
//! [`WorkerEvent::Failed`], with a [`WorkerEvent::Heartbeat`] every so often. When a step fails
//! the worker says where it stopped ([`WorkerEvent::StepFailed`]) and waits: the launcher tells
//! it to move to a new plan ([`LauncherMessage::Reconfigure`]), to roll back
//! ([`LauncherMessage::Rollback`]) or to stop, and a new rendezvous at the new epoch follows. The
//! launcher keeps the worker's stdin open for the whole run: its end of file means the launcher
//! is gone, and the worker stops (see the `lazarus-worker` crate).

use std::collections::BTreeMap;
use std::path::PathBuf;

use lazarus_comm::CommError;
use lazarus_model::{StepReport, TrainConfig};
use lazarus_plan::{Move, PlanUpdate, ReplicaMap};
use lazarus_runtime::{Reconfiguration, RuntimeError};
use serde::{Deserialize, Serialize};

/// What every worker process is sent on its stdin: its rank in the job, and the job.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WorkerSpec<J> {
    pub rank: usize,
    pub world: usize,
    /// Transport epoch of the job (stale connections from another run are refused).
    pub epoch: u64,
    /// Deadline of every collective, seconds.
    pub timeout_s: f64,
    /// The job's secret, 32 hex digits: every hello of the rendezvous carries it (sent on
    /// stdin, never on a command line).
    pub secret: String,
    /// The address to listen on for peers (default 127.0.0.1: every rank on this host). An
    /// agent sets its host's address, so that ranks on other hosts can reach it.
    #[serde(default)]
    pub bind: Option<String>,
    /// Seal every frame between the workers (AES-256-GCM, keys derived per connection from
    /// the secret; `lazarus_comm` `tcp::seal`).
    #[serde(default)]
    pub encrypt: bool,
    pub job: J,
}

/// A fresh random job secret (from the kernel's random source).
pub fn fresh_secret() -> Result<u128, std::io::Error> {
    use std::io::Read;
    let mut b = [0u8; 16];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut b)?;
    Ok(u128::from_le_bytes(b))
}

/// A secret as it travels in a spec.
pub fn secret_hex(secret: u128) -> String {
    format!("{secret:032x}")
}

/// A spec's secret, checked: 32 hex digits that look drawn at random. A secret of fewer than 6
/// distinct digits (all zeros, a repeated pattern) is refused: of the 16³² random ones, about one
/// in 10¹² has so few, and an operator who typed one has protected nothing.
pub fn parse_secret(hex: &str) -> Option<u128> {
    if hex.len() != 32 {
        return None;
    }
    let mut seen = [false; 16];
    for c in hex.chars() {
        seen[c.to_digit(16)? as usize] = true;
    }
    if seen.iter().filter(|&&s| s).count() < 6 {
        return None;
    }
    u128::from_str_radix(hex, 16).ok()
}

/// A `train --workers` rank's job.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrainJob {
    pub config: TrainConfig,
    pub plan: ReplicaMap,
    pub static_ep: bool,
    /// Deterministic steps (`train --deterministic`): bit-identical on any number of workers.
    #[serde(default)]
    pub deterministic: bool,
    /// Sequences in a shard of a deterministic step (`train --shard-sequences`; none: 1).
    #[serde(default)]
    pub shard_sequences: Option<usize>,
    /// Resume from the latest checkpoint in this directory.
    pub resume: Option<PathBuf>,
    /// Seconds between heartbeats (0: none).
    #[serde(default)]
    pub heartbeat_s: f64,
    /// Fault injection, as `LAZARUS_FAULT` takes it (empty: that variable, if set). For tests
    /// and `lazarus bench recovery`.
    #[serde(default)]
    pub faults: String,
    /// The worker joins a running job: it holds nothing, trains nothing and waits for the
    /// controller's move that takes it in (its spec's rank is its worker id; the move gives it
    /// its rank in the job).
    #[serde(default)]
    pub standby: bool,
    /// Snapshot experts into other nodes' memory (the snapshot tier; None: never).
    #[serde(default)]
    pub snapshots: Option<lazarus_runtime::SnapshotSettings>,
    /// Where each worker trains: `cpu`, `cuda` (a node's i-th worker on its GPU i mod the
    /// visible GPUs) or `cuda:N`.
    #[serde(default = "cpu_device")]
    pub device: String,
    /// Encrypt the workers' data connections (`--encrypt-data`).
    #[serde(default)]
    pub encrypt_data: bool,
    /// Held-out data to evaluate on (`--eval-data`; None: no evaluation).
    #[serde(default)]
    pub held_out: Option<HeldOut>,
}

/// The held-out data of a job and when its workers evaluate on it: after every `every` steps
/// (None: only after the last) and after the last, the mean loss over the first `windows`
/// windows of `tokens` ([`lazarus_model::eval`]), taken by every rank together.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HeldOut {
    pub tokens: Vec<u32>,
    pub every: Option<u64>,
    pub windows: usize,
}

impl HeldOut {
    /// Whether the workers evaluate after `step` (`last`: the run's last step).
    pub fn due(&self, step: u64, last: bool) -> bool {
        last || self.every.is_some_and(|k| k > 0 && step.is_multiple_of(k))
    }
}

fn cpu_device() -> String {
    "cpu".into()
}

/// The largest message of the control protocol a client takes from the controller (a node's
/// start with the job's replica map, a status with every member and the plan): bounded, and
/// far above what 16,384 workers need.
pub const MAX_CONTROL_MESSAGE: usize = 256 << 20;

/// Messages to workers longer than this travel to their agents compressed (`WorkerInput.deflated`).
pub const DEFLATE_LINES_OVER: usize = 64 << 10;

/// The most a compressed message (a node's job, a long line) may take once decompressed
/// ([`inflate_message`]): bounded, so a small message cannot inflate without end.
pub const MAX_INFLATED_BYTES: usize = 1 << 30;

/// A message as it travels compressed (a node's job in `StartWorkers.job`, a long message in
/// `WorkerInput`): zlib-compressed once for every node (a replica map at a thousand nodes
/// shrinks several times).
pub fn deflate_message(bytes: &[u8]) -> Vec<u8> {
    use std::io::Write as _;
    let mut z = flate2::write::ZlibEncoder::new(Vec::with_capacity(bytes.len() / 4), flate2::Compression::fast());
    // Writing to a Vec cannot fail.
    let _ = z.write_all(bytes);
    z.finish().unwrap_or_default()
}

/// A compressed message as it came, decompressed: at most [`MAX_INFLATED_BYTES`]. Err: why not.
pub fn inflate_bytes(deflated: &[u8]) -> Result<Vec<u8>, String> {
    inflate_at_most(deflated, MAX_INFLATED_BYTES)
}

fn inflate_at_most(deflated: &[u8], most: usize) -> Result<Vec<u8>, String> {
    use std::io::Read as _;
    let mut bytes = Vec::new();
    flate2::read::ZlibDecoder::new(deflated).take(most as u64 + 1).read_to_end(&mut bytes).map_err(|e| format!("not zlib data: {e}"))?;
    if bytes.len() > most {
        return Err(format!("larger than {most} bytes decompressed"));
    }
    Ok(bytes)
}

/// The variable a launcher sets to each worker process's index among the workers it starts
/// (its local worker number on the node): what picks its GPU.
pub const LOCAL_WORKER_ENV: &str = "LAZARUS_LOCAL_WORKER";

/// What the launcher tells a worker after its spec.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "msg", rename_all = "snake_case")]
pub enum LauncherMessage {
    /// Every rank's listening address for the rendezvous of `epoch`, in rank order.
    Addrs { epoch: u64, addrs: Vec<String> },
    /// Move to a new plan without losing state: commit up to `commit_to`, rendezvous at the
    /// epoch, fetch and send expert states, go on. The plan comes whole, or as changed from the
    /// one the worker has (a worker ready at the epoch it starts from).
    Reconfigure { commit_to: u64, to: MoveOrder },
    /// Reload the checkpoint of `to_step` (None: start afresh) under the new plan, rendezvous at
    /// its epoch, go on.
    Rollback { to_step: Option<u64>, to: MoveOrder },
    /// The transfers of the move to `epoch` that the workers this goes to send or receive, sent
    /// to each node just before the move's order (which every node shares and which lists none
    /// itself): a rebalance among a thousand nodes moves hundreds of thousands of expert states,
    /// and each node needs only its own.
    Transfers { epoch: u64, transfers: Vec<lazarus_plan::RankTransfer> },
    /// Give up the rendezvous of `epoch` (a rank of it was lost before it connected) and say
    /// where you stopped.
    Abandon { epoch: u64 },
    /// The controller gave up these ranks of `epoch` (lost by their lease: hung or cut off):
    /// cut the connections to them, so that a step waiting on them fails now, not at its
    /// deadline.
    Fence { epoch: u64, ranks: Vec<usize> },
    /// Stop after the step in progress at `epoch` (every rank stops after the same one) and
    /// say where you stopped: a planned move follows (workers joining).
    Pause { epoch: u64 },
    /// Stop after the step in flight at `epoch` (every rank after the same one), write the
    /// final checkpoint and end: the launcher was asked to stop (SIGTERM, Ctrl-C).
    Finish { epoch: u64 },
}

impl LauncherMessage {
    /// The plan epoch a message belongs to.
    pub fn epoch(&self) -> u64 {
        match self {
            LauncherMessage::Addrs { epoch, .. }
            | LauncherMessage::Abandon { epoch }
            | LauncherMessage::Fence { epoch, .. }
            | LauncherMessage::Pause { epoch }
            | LauncherMessage::Finish { epoch }
            | LauncherMessage::Transfers { epoch, .. } => *epoch,
            LauncherMessage::Reconfigure { to, .. } | LauncherMessage::Rollback { to, .. } => to.change.epoch,
        }
    }
}

/// A move as its workers are told it: one message for every worker that has the same map
/// (made once, and sent once to each node: at a thousand nodes of eight, a node loss's change
/// of the map goes 1,024 times, not 8,192). Its node's transfers come just before it
/// ([`LauncherMessage::Transfers`], [`TransfersAhead`]); each worker finds its rank by
/// its worker id and keeps the transfers it sends or receives ([`MoveOrder::for_worker`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MoveOrder {
    /// The worker (its id: the rank of its spec) of each rank of the new epoch.
    pub workers: Vec<u64>,
    /// The move, its plan as it travels. Its transfers are those listed with the order itself
    /// (the controller sends none here: each node gets its own in a
    /// [`LauncherMessage::Transfers`] before the order).
    #[serde(flatten)]
    pub change: Move<PlanUpdate>,
}

/// A node's transfers of the next move ([`LauncherMessage::Transfers`]), kept by a worker until
/// the order they belong to: several for one move add up; another move's start afresh.
#[derive(Debug, Default)]
pub struct TransfersAhead {
    epoch: u64,
    transfers: Vec<lazarus_plan::RankTransfer>,
}

impl TransfersAhead {
    pub fn add(&mut self, epoch: u64, transfers: Vec<lazarus_plan::RankTransfer>) {
        if epoch != self.epoch {
            (self.epoch, self.transfers) = (epoch, Vec::new());
        }
        self.transfers.extend(transfers);
    }

    /// `order` with the transfers kept for its move added; nothing is kept after it.
    pub fn complete(&mut self, mut order: MoveOrder) -> MoveOrder {
        let kept = std::mem::take(&mut self.transfers);
        if order.change.epoch == self.epoch {
            order.change.transfers.extend(kept);
        }
        order
    }
}

impl MoveOrder {
    /// What worker `id` does in this move: its rank, its transfers (`Err`: it is not in the
    /// move, or the order is malformed, said in words).
    pub fn for_worker(self, id: u64) -> Result<Reconfiguration<PlanUpdate>, String> {
        let (world, epoch) = (self.workers.len(), self.change.epoch);
        let Some(rank) = self.workers.iter().position(|&w| w == id) else {
            return Err(format!("worker {id} is not among the {world} workers of the move to epoch {epoch}"));
        };
        if let Some(r) = self.change.rank_beyond(world) {
            return Err(format!("the move to epoch {epoch} names rank {r}, beyond its {world} workers"));
        }
        let mut change = self.change;
        change.transfers.retain(|t| t.from == rank || t.to == rank);
        Ok(Reconfiguration { rank, world, change })
    }
}

/// What moving to a new plan took on one worker.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct MoveStats {
    /// Seconds to rendezvous at the new epoch (bind, exchange addresses, connect).
    pub rebuild_s: f64,
    /// Seconds to send and receive the expert states.
    pub transfer_s: f64,
    /// Bytes of expert state this worker received.
    pub bytes_received: u64,
    /// A GPU worker's device memory in use by its tensors after the move (its pool's count).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_used_bytes: Option<u64>,
}

/// Why a worker stopped, as it reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureKind {
    /// A peer's connection dropped: the worker itself is healthy.
    PeerLost,
    /// A peer did not answer within the collective deadline.
    Timeout,
    /// Another communication failure (protocol, stale epoch, rendezvous).
    Comm,
    /// The job cannot run as configured (placement, model, data).
    Config,
    /// Anything else.
    Error,
}

impl FailureKind {
    pub fn name(self) -> &'static str {
        match self {
            FailureKind::PeerLost => "peer_lost",
            FailureKind::Timeout => "timeout",
            FailureKind::Comm => "comm",
            FailureKind::Config => "config",
            FailureKind::Error => "error",
        }
    }

    /// The kind of a runtime error.
    pub fn of_runtime(e: &RuntimeError) -> Self {
        match e {
            RuntimeError::Comm(c) => Self::of_comm(c),
            RuntimeError::Invalid { .. } | RuntimeError::Model(_) | RuntimeError::Plan(_) | RuntimeError::Exact(_) => FailureKind::Config,
            RuntimeError::Candle(_) => FailureKind::Error,
        }
    }

    pub fn of_comm(e: &CommError) -> Self {
        match e {
            CommError::PeerLost { .. } => FailureKind::PeerLost,
            CommError::Timeout { .. } => FailureKind::Timeout,
            _ => FailureKind::Comm,
        }
    }
}

impl std::fmt::Display for FailureKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What a worker reports on stdout.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum WorkerEvent {
    /// Listening for the rendezvous of `epoch`.
    Listening {
        addr: String,
        #[serde(default)]
        epoch: u64,
    },
    /// Connected to every peer of `epoch` and ready to train (after a reconfiguration: the
    /// transfers done, with what they took).
    Ready {
        pid: u32,
        #[serde(default)]
        epoch: u64,
        #[serde(default)]
        moved: Option<MoveStats>,
    },
    /// Alive (sent every so often, whatever the worker is doing).
    Heartbeat,
    /// A step failed at `epoch`: where this worker stopped. It waits for the launcher.
    StepFailed {
        epoch: u64,
        steps_done: u64,
        held: Option<u64>,
        /// The experts resident on this worker, per layer (what it can give a survivor).
        holds: Vec<Vec<usize>>,
        kind: FailureKind,
        message: String,
        /// The global report of its last committed step (`steps_done`), if it has it.
        #[serde(default)]
        last: Option<CommittedStep>,
        /// The expert snapshots it keeps for other nodes.
        #[serde(default)]
        snapshots: Vec<lazarus_decide::SnapshotHeld>,
    },
    /// This worker left the job after the move that drained its node (it held nothing any
    /// more); it exits.
    Left,
    /// Paused at `epoch` as the controller asked, between steps: where this worker stopped.
    /// It waits for the launcher.
    Paused {
        epoch: u64,
        steps_done: u64,
        holds: Vec<Vec<usize>>,
        #[serde(default)]
        snapshots: Vec<lazarus_decide::SnapshotHeld>,
    },
    /// The held-out loss after `step` (rank 0, for every rank: [`HeldOut`]).
    Evaluated {
        step: u64,
        evaluation: lazarus_model::eval::Evaluation,
    },
    /// Rank 0 wrote a checkpoint of `step`.
    Checkpointed {
        step: u64,
        path: PathBuf,
    },
    /// A finished step (rank 0 only): the global report, its wall time and the bytes its MoE
    /// all-to-alls sent, summed over the workers. `dropped` counts step reports before this one that were not sent because the
    /// launcher was not reading (progress never blocks training).
    Step {
        report: StepReport,
        seconds: f64,
        wire_bytes: u64,
        #[serde(default)]
        dropped: u64,
        /// What the step's snapshots cost (None: the job takes none).
        #[serde(default)]
        snapshot: Option<lazarus_runtime::SnapshotStepStats>,
    },
    Done {
        checkpoint: Option<PathBuf>,
    },
    /// What the work of a job that is not training came to (rank 0 only; a benchmark's
    /// results), opaque to the control plane: its caller reads it (`run_local_job` in the `lazarus-controller` crate).
    Results {
        results: serde_json::Value,
    },
    /// The worker stopped.
    Failed {
        kind: FailureKind,
        message: String,
    },
}

/// A committed step's global report (every rank has the all-reduced loss and loads) and its
/// A move's transfers as its nodes are sent them: for each node (`node_of_rank[r]`: the node of
/// rank r), those its ranks send or receive, in the move's order (a transfer between two nodes
/// goes to both). Ranks beyond `node_of_rank` belong to no node: their transfers go nowhere
/// (`MoveOrder::for_worker` refuses such an order anyway).
pub fn transfers_by_node(transfers: &[lazarus_plan::RankTransfer], node_of_rank: &[u64]) -> BTreeMap<u64, Vec<lazarus_plan::RankTransfer>> {
    let mut by_node: BTreeMap<u64, Vec<lazarus_plan::RankTransfer>> = BTreeMap::new();
    for t in transfers {
        let (from, to) = (node_of_rank.get(t.from), node_of_rank.get(t.to));
        if let Some(&n) = from {
            by_node.entry(n).or_default().push(*t);
        }
        if let Some(&n) = to.filter(|&n| Some(n) != from) {
            by_node.entry(n).or_default().push(*t);
        }
    }
    by_node
}

/// seconds, as a survivor keeps it: the log gets it from a survivor when rank 0 committed the
/// step but was lost before its report got out.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CommittedStep {
    pub report: StepReport,
    pub seconds: f64,
}

/// The controller weighs a committed step by its number and whether its figures can be true.
impl lazarus_decide::StepRecord for CommittedStep {
    fn step(&self) -> u64 {
        self.report.step
    }

    fn is_sound(&self) -> bool {
        self.report.loss.is_finite() && self.seconds.is_finite() && self.seconds >= 0.0
    }
}

/// A worker's lease in a job without live recovery: the collective deadline (at least 1 s). A
/// hung worker is found out no later than its peers would notice it.
pub fn lease_without_recovery(comm_timeout_s: f64) -> std::time::Duration {
    std::time::Duration::from_secs_f64(comm_timeout_s.max(1.0))
}

/// How often a worker says it is alive: five times per lease.
pub fn heartbeat_within(lease: std::time::Duration) -> std::time::Duration {
    lease / 5
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn held_out_evaluations_fall_after_every_k_steps_and_the_last() {
        let h = HeldOut { tokens: vec![1, 2, 3], every: Some(3), windows: 1 };
        let due: Vec<u64> = (1..=8).filter(|&s| h.due(s, s == 8)).collect();
        assert_eq!(due, vec![3, 6, 8]);
        let at_end = HeldOut { every: None, ..h.clone() };
        assert_eq!((1..=8).filter(|&s| at_end.due(s, s == 8)).collect::<Vec<_>>(), vec![8]);
        let zero = HeldOut { every: Some(0), ..h };
        assert!(!zero.due(4, false), "a zero period is never due (the CLI refuses it)");
    }

    /// Every worker of a move is sent the same order and finds its own part in it: its rank by
    /// its id, the transfers it sends or receives; a worker not in it, or an order naming a rank
    /// beyond its workers, is an error.
    #[test]
    fn a_move_order_gives_each_worker_its_rank_and_its_transfers() {
        use lazarus_plan::RankTransfer;
        let map = ReplicaMap::new(4, vec![vec![vec![1, 1, 0], vec![0, 1, 1]]]).unwrap();
        let t = |from, to| RankTransfer { layer: 0, expert: 1, from, to };
        let order = MoveOrder {
            workers: vec![7, 9, 4],
            change: Move {
                catch_up: vec![(0, 1, 30)],
                joining: vec![2],
                ..Move::new(4, PlanUpdate::Whole { map: std::sync::Arc::new(map) }, vec![t(1, 2), t(0, 1), t(2, 0)])
            },
        };
        let line = serde_json::to_string(&LauncherMessage::Reconfigure { commit_to: 5, to: order.clone() }).unwrap();
        let LauncherMessage::Reconfigure { to: back, .. } = serde_json::from_str(&line).unwrap() else { panic!("{line}") };
        assert_eq!(back, order);
        let nine = order.clone().for_worker(9).unwrap();
        assert_eq!((nine.rank, nine.world, nine.change.epoch), (1, 3, 4));
        assert_eq!(nine.change.transfers, vec![t(1, 2), t(0, 1)]);
        assert_eq!((nine.change.joining, nine.change.catch_up), (vec![2], vec![(0, 1, 30)]));
        assert_eq!(order.clone().for_worker(4).unwrap().change.transfers, vec![t(1, 2), t(2, 0)]);
        assert!(order.clone().for_worker(8).unwrap_err().contains("worker 8 is not among the 3 workers"));
        let mut beyond = order.clone();
        beyond.change.transfers = vec![t(0, 3)];
        assert!(beyond.for_worker(7).unwrap_err().contains("names rank 3, beyond"));
        let mut leaver = order;
        leaver.change.leaving = vec![5];
        assert!(leaver.for_worker(7).is_err());
    }

    /// A move's transfers sent apart, each node its own, before an order that lists none: every
    /// worker finds the same part as in the order that listed them all.
    #[test]
    fn each_node_is_sent_the_transfers_of_its_workers_and_finds_the_same_part() {
        use lazarus_plan::RankTransfer;
        let map = ReplicaMap::new(6, vec![vec![vec![1, 1, 0, 1, 0, 1], vec![0, 1, 1, 0, 1, 0]]]).unwrap();
        let t = |expert, from, to| RankTransfer { layer: 0, expert, from, to };
        // Six ranks on three nodes (two a node); transfers within a node and across.
        let transfers = vec![t(1, 1, 2), t(0, 0, 1), t(1, 5, 0), t(0, 3, 4), t(1, 2, 3), t(0, 4, 5)];
        let node_of_rank = [30, 30, 10, 10, 20, 20];
        let whole = MoveOrder {
            workers: vec![7, 9, 4, 3, 11, 12],
            change: Move::new(8, PlanUpdate::Whole { map: std::sync::Arc::new(map) }, transfers.clone()),
        };
        let by_node = transfers_by_node(&transfers, &node_of_rank);
        assert_eq!(by_node.keys().copied().collect::<Vec<_>>(), vec![10, 20, 30]);
        assert_eq!(by_node[&10], vec![t(1, 1, 2), t(0, 3, 4), t(1, 2, 3)], "a transfer inside a node is listed once, in order");
        assert_eq!(by_node.values().map(Vec::len).sum::<usize>(), 9, "3 between nodes (twice), 3 within (once)");
        let mut shared = whole.clone();
        shared.change.transfers.clear();
        for (rank, &id) in whole.workers.iter().enumerate() {
            let part = by_node[&node_of_rank[rank]].clone();
            let line = serde_json::to_string(&LauncherMessage::Transfers { epoch: 8, transfers: part }).unwrap();
            let LauncherMessage::Transfers { epoch, transfers: part } = serde_json::from_str(&line).unwrap() else { panic!("{line}") };
            // Another move's transfers before them are dropped; a part in two halves adds up.
            let mut ahead = TransfersAhead::default();
            ahead.add(7, vec![t(0, 0, 1)]);
            let half = part.len() / 2;
            ahead.add(epoch, part[..half].to_vec());
            ahead.add(epoch, part[half..].to_vec());
            assert_eq!(ahead.complete(shared.clone()).for_worker(id).unwrap(), whole.clone().for_worker(id).unwrap(), "rank {rank}");
            assert!(ahead.complete(shared.clone()).change.transfers.is_empty(), "nothing kept after its order");
        }
        // A rank beyond the nodes named: its transfer goes to the node it names only.
        assert_eq!(transfers_by_node(&[t(0, 0, 9)], &node_of_rank), BTreeMap::from([(30, vec![t(0, 0, 9)])]));
    }

    /// A compressed message comes back as it went; what is not zlib, or inflates past the
    /// bound, is refused with the reason.
    #[test]
    fn a_compressed_message_is_checked_when_it_comes() {
        let message = b"the same words, the same words, the same words";
        assert_eq!(inflate_bytes(&deflate_message(message)).unwrap(), message);
        assert!(inflate_bytes(message).unwrap_err().contains("zlib"));
        // A bomb: a little that inflates past the bound is cut off there.
        let bomb = deflate_message(&vec![b' '; (1 << 20) + 2]);
        assert!(bomb.len() < 10_000);
        assert!(inflate_at_most(&bomb, 1 << 20).unwrap_err().contains("larger than 1048576"));
        assert!(inflate_at_most(&deflate_message(message), message.len()).is_ok());
    }

    #[test]
    fn events_are_one_json_object_with_an_event_tag() {
        let e = WorkerEvent::Failed { kind: FailureKind::PeerLost, message: "peer 1 lost".into() };
        let line = serde_json::to_string(&e).unwrap();
        assert_eq!(line, r#"{"event":"failed","kind":"peer_lost","message":"peer 1 lost"}"#);
        assert!(matches!(serde_json::from_str(&line).unwrap(), WorkerEvent::Failed { kind: FailureKind::PeerLost, .. }));
        assert!(serde_json::from_str::<WorkerEvent>(r#"{"event":"failed","kind":"meltdown","message":""}"#).is_err());
    }

    #[test]
    fn failure_kinds_of_errors() {
        let lost = CommError::PeerLost { peer: 2, reason: "gone".into() };
        assert_eq!(FailureKind::of_runtime(&RuntimeError::Comm(lost)), FailureKind::PeerLost);
        let late = CommError::Timeout { peer: 2, what: "x".into() };
        assert_eq!(FailureKind::of_comm(&late), FailureKind::Timeout);
        let bad = RuntimeError::Invalid { field: "placement", reason: "x".into() };
        assert_eq!(FailureKind::of_runtime(&bad), FailureKind::Config);
    }

    #[test]
    fn secrets_travel_as_32_hex_digits() {
        let s = fresh_secret().unwrap();
        assert_eq!(parse_secret(&secret_hex(s)), Some(s));
        assert_ne!(fresh_secret().unwrap(), s);
        for bad in ["", "00", &"g".repeat(32), &"0".repeat(33), &"0".repeat(32), &"ab".repeat(16), &"01234".repeat(7)[..32]] {
            assert_eq!(parse_secret(bad), None, "{bad}");
        }
        // Six distinct digits are enough to be taken (a random secret has about 14).
        assert!(parse_secret(&"012345".repeat(6)[..32]).is_some());
    }
}
