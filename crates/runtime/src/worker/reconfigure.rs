//! Moving a worker to a new plan after a failure (paper §4.3; docs/architecture.md, what a
//! failure does): the survivors renumber into a new world at a new epoch, each fetches the expert
//! states (weights **and** AdamW m, v, step) its new placement needs from a surviving holder,
//! frees the experts it no longer holds, and the same step is run again over the new world —
//! same global batch, split over fewer ranks.

use lazarus_comm::tags::{expert_transfer, TransferKind};
use lazarus_comm::{barrier, deadline_after, Group, Transport};
use lazarus_plan::{Move, ReplicaMap};
use serde::{Deserialize, Serialize};

use super::{build_layers, check_plan, FaultPoint, Worker};
use crate::error::RuntimeError;
use crate::expert_state::ExpertState;
use crate::shared_state::SharedState;

/// Everything a surviving worker is told to move to the new plan: the move
/// ([`lazarus_plan::Move`], the one shape a move has from the decision on) and this worker's
/// place in its world. `P` is how the plan comes: a [`ReplicaMap`] (what the worker moves with),
/// or as it travels, whole or as changed from the map the worker has
/// ([`lazarus_plan::PlanUpdate`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reconfiguration<P = ReplicaMap> {
    /// This worker's rank in the new world.
    pub rank: usize,
    pub world: usize,
    #[serde(flatten)]
    pub change: Move<P>,
}

impl<P> Reconfiguration<P> {
    /// The same move with its plan as `f` makes it of this one's (e.g. a change resolved).
    pub fn map_plan<Q, E>(self, f: impl FnOnce(P) -> Result<Q, E>) -> Result<Reconfiguration<Q>, E> {
        Ok(Reconfiguration { rank: self.rank, world: self.world, change: self.change.map_plan(f)? })
    }

    /// The rank that sends joiner `rank` the replicated state (None: `rank` does not join, or
    /// nobody can send it).
    pub fn shared_source(&self, rank: usize) -> Option<usize> {
        self.change.shared_source(rank, self.world)
    }
}

/// What a reconfiguration moved on this rank.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReconfigureReport {
    pub experts_sent: usize,
    pub experts_received: usize,
    pub bytes_sent: u64,
    pub bytes_received: u64,
}

impl Worker {
    /// Move to `r` over `t`, the new epoch's transport (rank and world as `r` says), `world` its
    /// group of every rank. Every
    /// surviving rank must call it together, all at the same committed step (a held step is
    /// committed or dropped first). A rank sends every state it is the source of, then receives
    /// what it fetches; then each rank keeps exactly the experts the new plan gives it.
    pub fn reconfigure(
        &mut self,
        r: &Reconfiguration,
        t: &mut dyn Transport,
        world: &mut Group,
    ) -> Result<ReconfigureReport, RuntimeError> {
        let bad = |reason: String| RuntimeError::Invalid { field: "reconfiguration", reason };
        let mc = self.trainer.model.config().clone();
        let transfers = self.checked_move(r, t)?;
        let timeout = self.timeout;
        let deadline = || deadline_after(timeout);
        let mut report = ReconfigureReport::default();
        // Sends first: the transport never blocks a send on a peer that is sending too. The
        // replicated state to the joiners this rank serves, then expert states.
        let shared_tag = expert_transfer(TransferKind::SharedState, 0, 0)?;
        let served: Vec<usize> = r.change.joining.iter().copied().filter(|&j| r.shared_source(j) == Some(r.rank)).collect();
        if !served.is_empty() {
            let bytes = self.export_shared()?.encode();
            for j in served {
                t.send(j, shared_tag, &bytes, deadline())?;
                report.bytes_sent += bytes.len() as u64;
            }
        }
        self.snapshots.new_epoch();
        for x in transfers.iter().filter(|x| x.from == r.rank) {
            // An expert that lost every live replica is sent from this rank's snapshot of it.
            let state = match self.trainer.model.expert_resident(x.layer, x.expert)? {
                true => self.export_expert(x.layer, x.expert)?,
                false => self.snapshot_state(x.layer, x.expert)?.ok_or_else(|| {
                    bad(format!("rank {} is to send layer {} expert {} but holds neither it nor a snapshot", r.rank, x.layer, x.expert))
                })?,
            };
            let bytes = state.encode();
            t.send(x.to, expert_transfer(TransferKind::StateTransfer, x.layer, x.expert)?, &bytes, deadline())?;
            report.experts_sent += 1;
            report.bytes_sent += bytes.len() as u64;
        }
        self.fault_point(FaultPoint::Transfer, self.trainer.step);
        if let Some(from) = r.shared_source(r.rank) {
            let bytes = t.recv(from, shared_tag, deadline())?;
            let state = SharedState::decode(&bytes, &self.shared_shapes()).map_err(|e| bad(format!("rank {from} sent: {e}")))?;
            self.install_shared(&state)?;
            report.bytes_received += bytes.len() as u64;
        }
        let shapes = self.trainer.model.expert_shapes();
        for x in transfers.iter().filter(|x| x.to == r.rank) {
            let bytes = t.recv(x.from, expert_transfer(TransferKind::StateTransfer, x.layer, x.expert)?, deadline())?;
            let state = ExpertState::decode(&bytes, x.layer, x.expert, &shapes)
                .map_err(|e| bad(format!("rank {} sent layer {} expert {}: {e}", x.from, x.layer, x.expert)))?;
            self.install_expert(&state)?;
            report.experts_received += 1;
            report.bytes_received += bytes.len() as u64;
        }
        // Every expert the new plan places here must be here now: received, held, or restored
        // from a snapshot this rank keeps (its live replicas all lost).
        for l in 0..mc.moe_layers() {
            for e in 0..mc.n_experts {
                if r.change.plan.replicas_on(l, e, r.rank) > 0 && !self.trainer.model.expert_resident(l, e)? {
                    if let Some(state) = self.snapshot_state(l, e)? {
                        self.install_expert(&state)?;
                        continue;
                    }
                    return Err(bad(format!("rank {} is given layer {l} expert {e} but neither holds it nor fetches it", r.rank)));
                }
            }
        }
        // Every rank has what it needs; only then does anyone let go of what it held. A rank
        // lost before this point leaves every survivor on its old plan, holding all it held
        // and what it received ([`Worker::resident_experts`]) — a state the next move starts from.
        barrier(t, world, self.timeout)?;
        self.plan = r.change.plan.clone();
        self.rank = r.rank;
        self.world = r.world;
        self.release_remote_experts()?;
        self.layers = build_layers(&self.trainer, &self.plan, self.rank, self.mode, self.timeout)?;
        self.catch_up = r
            .change
            .catch_up
            .iter()
            .filter(|c| c.0 < mc.moe_layers() && c.1 < mc.n_experts && c.2 > 0)
            .map(|c| ((c.0, c.1), c.2))
            .collect();
        Ok(report)
    }

    /// Whether this rank can carry out `r` over `t`: nothing held, the transport the move's, the
    /// plan and every transfer and joiner within the model and the world. The move's transfers,
    /// in the order every rank carries them out.
    fn checked_move(&self, r: &Reconfiguration, t: &dyn Transport) -> Result<Vec<lazarus_plan::RankTransfer>, RuntimeError> {
        let bad = |reason: String| RuntimeError::Invalid { field: "reconfiguration", reason };
        if self.held.is_some() {
            return Err(bad("a held step must be committed or dropped first".into()));
        }
        if (t.rank(), t.world(), t.epoch()) != (r.rank, r.world, r.change.epoch) {
            return Err(bad(format!(
                "the transport is rank {} of {} at epoch {}, the reconfiguration rank {} of {} at epoch {}",
                t.rank(),
                t.world(),
                t.epoch(),
                r.rank,
                r.world,
                r.change.epoch
            )));
        }
        let mc = self.trainer.model.config();
        check_plan(&r.change.plan, mc.moe_layers(), mc.n_experts, r.world, self.mode)?;
        for x in &r.change.transfers {
            if x.layer >= mc.moe_layers() || x.expert >= mc.n_experts || x.from >= r.world || x.to >= r.world || x.from == x.to {
                return Err(bad(format!(
                    "transfer {x:?} does not fit {} layers x {} experts over {} ranks",
                    mc.moe_layers(),
                    mc.n_experts,
                    r.world
                )));
            }
            if r.change.plan.replicas_on(x.layer, x.expert, x.to) == 0 {
                return Err(bad(format!("transfer {x:?} sends layer {} expert {} to a rank the plan does not give it", x.layer, x.expert)));
            }
        }
        for &j in &r.change.joining {
            if j >= r.world || r.shared_source(j).is_none() {
                return Err(bad(format!("joiner {j} of a world of {} has no rank to take the job's state from", r.world)));
            }
        }
        if r.change.transfers.iter().any(|x| r.change.joining.contains(&x.from)) {
            return Err(bad("a joining rank cannot be the source of a transfer".into()));
        }
        let mut transfers = r.change.transfers.clone();
        transfers.sort_by_key(|x| (x.layer, x.expert, x.to));
        Ok(transfers)
    }
}
