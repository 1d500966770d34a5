//! The workers of a job started by agents, as the controller's loop drives them: a [`Fleet`]
//! over the hub — reports and exits in, each rank's messages out to its agent's slot — and how
//! the workers of an agent that joins are started.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{AgentHub, HubInput};
use crate::fleet::{Fleet, FleetEvent};
use lazarus_protocol::proto::{self, controller_message};
use lazarus_protocol::ControlError;
use lazarus_protocol::LauncherMessage;

/// The slot of a worker that joins the running job: `(worker id, host, epoch)`.
pub(crate) type JoinerSpec = Box<dyn Fn(usize, &str, u64) -> proto::WorkerSlot + Send>;

/// How the workers of an agent that joins the running job are started: the job they run (its
/// JSON compressed, sent once to the agent) and each one's slot.
pub(crate) struct Joiner {
    pub job: prost::bytes::Bytes,
    pub spec: JoinerSpec,
}

/// The workers of a job started by agents: the controller's loop drives them through this.
pub struct RemoteFleet {
    hub: Arc<AgentHub>,
    inputs: Receiver<HubInput>,
    /// The agent and slot of each rank.
    owners: Vec<(u64, usize)>,
    /// The rank of each agent's slot (the inverse of `owners`).
    rank_at: HashMap<(u64, usize), usize>,
    /// Exits not yet handed out (every worker of an agent that is gone).
    pending: VecDeque<usize>,
    exits: BTreeMap<usize, String>,
    /// Ranks the controller had killed.
    killed: std::collections::BTreeSet<usize>,
    /// How to start a worker that joins.
    joiner: Joiner,
    /// Workers started for agents that joined, one node's at a time, not yet told of.
    joined: VecDeque<Vec<usize>>,
    /// Nodes that gave notice, not yet told of: their workers and why.
    leaving: VecDeque<(Vec<usize>, String)>,
}

impl RemoteFleet {
    pub(super) fn new(hub: Arc<AgentHub>, inputs: Receiver<HubInput>, owners: Vec<(u64, usize)>, joiner: Joiner) -> Self {
        let rank_at = owners.iter().enumerate().map(|(rank, &o)| (o, rank)).collect();
        RemoteFleet {
            hub,
            inputs,
            owners,
            rank_at,
            pending: VecDeque::new(),
            exits: BTreeMap::new(),
            killed: Default::default(),
            joiner,
            joined: VecDeque::new(),
            leaving: VecDeque::new(),
        }
    }

    fn rank_of(&self, agent: u64, slot: usize) -> Option<usize> {
        self.rank_at.get(&(agent, slot)).copied()
    }

    /// Rank `rank` is worker `slot` of `agent`.
    fn own(&mut self, rank: usize, agent: u64, slot: usize) {
        if rank == self.owners.len() {
            self.owners.push((agent, slot));
        }
        let Some(o) = self.owners.get_mut(rank) else { return };
        if self.rank_at.get(o) == Some(&rank) {
            self.rank_at.remove(o);
        }
        *o = (agent, slot);
        self.rank_at.insert((agent, slot), rank);
    }

    /// An agent attached to the running job: number its workers after every worker so far and
    /// start them standing by (the controller takes them in at a step boundary).
    fn take_in(&mut self, agent: u64) {
        let first = self.owners.len();
        let Some((gpus, host)) = self.hub.assign(agent, first) else { return };
        let epoch = self.hub.epoch();
        let workers = (first..first + gpus).map(|id| (self.joiner.spec)(id, &host, epoch)).collect();
        for slot in 0..gpus {
            self.own(first + slot, agent, slot);
        }
        let job = self.joiner.job.clone();
        self.hub.send_to(agent, epoch, controller_message::Body::Start(proto::StartWorkers { workers, job, standby: true }));
        self.joined.push_back((first..first + gpus).collect());
    }

    /// The agents and their workers' ranks, for the user.
    pub fn ranks_of(&self, agent: u64) -> Vec<usize> {
        (0..self.owners.len()).filter(|&r| self.owners[r].0 == agent).collect()
    }
}

impl Fleet for RemoteFleet {
    fn next_event(&mut self, wait: Duration) -> Option<FleetEvent> {
        let until = Instant::now() + wait;
        loop {
            // Joins first, then notices, then exits already known (an agent gone).
            if let Some(workers) = self.joined.pop_front() {
                return Some(FleetEvent::Joined { workers });
            }
            if let Some((workers, reason)) = self.leaving.pop_front() {
                return Some(FleetEvent::Leaving { workers, reason });
            }
            if let Some(rank) = self.pending.pop_front() {
                return Some(FleetEvent::Exited { rank });
            }
            let left = until.saturating_duration_since(Instant::now());
            let input = match self.inputs.recv_timeout(left) {
                Ok(x) => x,
                Err(RecvTimeoutError::Timeout) => return None,
                Err(RecvTimeoutError::Disconnected) => {
                    std::thread::sleep(left.min(Duration::from_millis(50)));
                    return None;
                }
            };
            match input {
                HubInput::Report { agent, slot, event } => {
                    if let Some(rank) = self.rank_of(agent, slot) {
                        return Some(FleetEvent::Report { rank, event });
                    }
                }
                HubInput::Exited { agent, slot, status } => {
                    if let Some(rank) = self.rank_of(agent, slot) {
                        if self.exits.insert(rank, status).is_none() {
                            return Some(FleetEvent::Exited { rank });
                        }
                    }
                }
                HubInput::Gone { agent, why } => {
                    for rank in self.ranks_of(agent) {
                        if let std::collections::btree_map::Entry::Vacant(e) = self.exits.entry(rank) {
                            e.insert(format!("its agent {agent} is gone: {why}"));
                            self.pending.push_back(rank);
                        }
                    }
                }
                HubInput::Joined { agent } => self.take_in(agent),
                HubInput::Rejoined { agent, first } => {
                    for slot in 0..self.hub.gpus_per_node {
                        if first + slot < self.owners.len() {
                            self.own(first + slot, agent, slot);
                        }
                    }
                }
                HubInput::Leaving { agent, reason } => {
                    let ranks = self.ranks_of(agent);
                    if !ranks.is_empty() {
                        self.leaving.push_back((ranks, format!("agent {agent}: {reason}")));
                    }
                }
            }
        }
    }

    fn exit_status(&mut self, rank: usize) -> String {
        self.exits.get(&rank).cloned().unwrap_or_else(|| "unknown".into())
    }

    fn send(&mut self, rank: usize, message: &LauncherMessage) -> Result<(), ControlError> {
        self.send_many(&[rank], message)
    }

    /// The message is made once, and each agent is sent it once for all its workers among
    /// `ranks` (at a thousand nodes of eight, a rendezvous's addresses go 1,024 times, not 8,192).
    fn send_many(&mut self, ranks: &[usize], message: &LauncherMessage) -> Result<(), ControlError> {
        let bytes = lazarus_protocol::relay::orders::encode(message);
        // A long message (a move's change of the map) is compressed once for every agent.
        let deflated = bytes.len() > lazarus_protocol::DEFLATE_LINES_OVER;
        let bytes = prost::bytes::Bytes::from(if deflated { lazarus_protocol::deflate_message(&bytes) } else { bytes });
        // Each agent's workers among them, by the epoch their messages are stamped with.
        let mut slots: BTreeMap<(u64, u64), Vec<u32>> = BTreeMap::new();
        {
            let mut st = self.hub.state();
            for &rank in ranks {
                let (Some(&(agent, slot)), Some(&at)) = (self.owners.get(rank), st.rank_epoch.get(rank)) else { continue };
                let epoch = at.max(message.epoch());
                st.rank_epoch[rank] = epoch;
                st.epoch = st.epoch.max(epoch);
                slots.entry((agent, epoch)).or_default().push(slot as u32);
            }
        }
        for ((agent, epoch), slots) in slots {
            self.hub.send_to(agent, epoch, controller_message::Body::Input(proto::WorkerInput { slots, message: bytes.clone(), deflated }));
        }
        Ok(())
    }

    fn kill(&mut self, rank: usize, reason: &str) {
        let Some(&(agent, slot)) = self.owners.get(rank) else { return };
        let epoch = self.hub.state().epoch;
        self.hub.send_to(agent, epoch, controller_message::Body::Kill(proto::KillWorker { slot: slot as u32, reason: reason.into() }));
        // An agent none of whose workers is left is given up: its stream ends, and it stops.
        self.killed.insert(rank);
        if self.ranks_of(agent).iter().all(|r| self.killed.contains(r) || self.exits.contains_key(r)) {
            self.hub.drop_agent(agent, &format!("every worker of it is lost ({reason})"));
        }
    }

    fn kill_all(&mut self, reason: &str) {
        self.hub.shutdown(reason, false);
    }

    fn finish(&mut self, how: &str) {
        self.hub.shutdown(how, true);
    }

    fn without_a_controller(&self) -> Option<Duration> {
        let st = self.hub.state();
        st.taking_back.then(|| Duration::from_millis(st.longest_orphaned_ms))
    }
}
