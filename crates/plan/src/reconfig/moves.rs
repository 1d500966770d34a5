//! One move of the job to a new plan, in the one shape it keeps from the controller's decision
//! to the worker that carries it out (paper §4.3). Each hop adds only who is who: the decision
//! names the nodes' workers of each rank (`lazarus_decide::MoveDecision`), the order sent to the
//! agents names the workers (`lazarus_protocol::MoveOrder`), and a worker is told its rank
//! (`lazarus_runtime::Reconfiguration`); the move itself is this type all the way.

use serde::{Deserialize, Serialize};

use super::RankTransfer;
use crate::scheduler::ReplicaMap;

/// The new plan at a new epoch and what every rank does to get there. `P` is how the plan
/// comes: a [`ReplicaMap`] (as decided, and as a worker moves with it), or as it travels, whole
/// or as changed from the map a worker has ([`crate::PlanUpdate`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Move<P = ReplicaMap> {
    /// The new plan epoch (the new transport's).
    pub epoch: u64,
    /// Replicas of each expert on each rank of the new world.
    pub plan: P,
    /// The expert states copied between ranks of the new world (a worker is told those it
    /// sends or receives).
    pub transfers: Vec<RankTransfer>,
    /// Experts restored from a stale snapshot in this move: (layer, expert, tokens it lost).
    /// Each catches up on them through the router (MoEtion §6) until about that many extra
    /// tokens were routed to it; a later move replaces the list (every rank the same).
    #[serde(default)]
    pub catch_up: Vec<(usize, usize, u64)>,
    /// Ranks of the new world that join the job now (they hold nothing of it yet): each takes
    /// the replicated state from one of the other ranks ([`Move::shared_source`]).
    #[serde(default)]
    pub joining: Vec<usize>,
    /// Ranks that leave the job after this move (a node drained before it is taken away): they
    /// send what only they hold and hold nothing of the plan (its rows are 0 for them).
    #[serde(default)]
    pub leaving: Vec<usize>,
    /// After the move, train nothing and say where you stopped: the controller moves the job
    /// again (without the leaving ranks) at once.
    #[serde(default)]
    pub hold: bool,
}

impl<P> Move<P> {
    /// A move to `plan` at `epoch` with these transfers: nobody joins, leaves or catches up, and
    /// training goes on after it.
    pub fn new(epoch: u64, plan: P, transfers: Vec<RankTransfer>) -> Self {
        Move { epoch, plan, transfers, catch_up: Vec::new(), joining: Vec::new(), leaving: Vec::new(), hold: false }
    }

    /// The same move with its plan as `f` makes it of this one's (a map sent as its change, a
    /// change resolved against the map a worker has).
    pub fn map_plan<Q, E>(self, f: impl FnOnce(P) -> Result<Q, E>) -> Result<Move<Q>, E> {
        Ok(Move {
            epoch: self.epoch,
            plan: f(self.plan)?,
            transfers: self.transfers,
            catch_up: self.catch_up,
            joining: self.joining,
            leaving: self.leaving,
            hold: self.hold,
        })
    }

    /// This move with `plan` in place of its own and no transfers listed: the order every node
    /// is sent when each is sent its own transfers apart.
    pub fn without_transfers<Q>(&self, plan: Q) -> Move<Q> {
        let (catch_up, joining, leaving) = (self.catch_up.clone(), self.joining.clone(), self.leaving.clone());
        Move { epoch: self.epoch, plan, transfers: Vec::new(), catch_up, joining, leaving, hold: self.hold }
    }

    /// The first rank at or beyond `world` that the move names (a joiner, a leaver or a
    /// transfer's end), if any: a move that names one is malformed.
    pub fn rank_beyond(&self, world: usize) -> Option<usize> {
        let ends = self.transfers.iter().flat_map(|t| [t.from, t.to]);
        self.joining.iter().chain(&self.leaving).copied().chain(ends).find(|&r| r >= world)
    }

    /// The rank of a world of `world` that sends joiner `rank` the replicated state: the
    /// `i`-th joiner takes it from the `i mod n`-th of the `n` ranks not joining, spreading the
    /// copies over them. None: `rank` does not join, or nobody can send it.
    pub fn shared_source(&self, rank: usize, world: usize) -> Option<usize> {
        let i = self.joining.iter().position(|&j| j == rank)?;
        let sources: Vec<usize> = (0..world).filter(|r| !self.joining.contains(r)).collect();
        (!sources.is_empty()).then(|| sources[i % sources.len()])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a_move(joining: Vec<usize>) -> Move<()> {
        Move { joining, ..Move::new(3, (), vec![]) }
    }

    #[test]
    fn joiners_take_the_shared_state_from_the_others_in_turn() {
        let m = a_move(vec![1, 3, 4]);
        let got: Vec<Option<usize>> = (0..5).map(|r| m.shared_source(r, 5)).collect();
        assert_eq!(got, vec![None, Some(0), None, Some(2), Some(0)]);
        assert_eq!(a_move(vec![0, 1]).shared_source(0, 2), None, "nobody to send it");
    }

    #[test]
    fn a_rank_beyond_the_world_is_found_wherever_it_is_named() {
        let t = |from, to| RankTransfer { layer: 0, expert: 0, from, to };
        assert_eq!(a_move(vec![1]).rank_beyond(2), None);
        assert_eq!(a_move(vec![2]).rank_beyond(2), Some(2));
        assert_eq!(Move { leaving: vec![5], ..a_move(vec![]) }.rank_beyond(4), Some(5));
        assert_eq!(Move { transfers: vec![t(0, 1), t(3, 0)], ..a_move(vec![]) }.rank_beyond(3), Some(3));
    }

    #[test]
    fn the_json_of_a_move_without_its_defaults_reads() {
        let m: Move<u8> = serde_json::from_str(r#"{"epoch":2,"plan":7,"transfers":[]}"#).unwrap();
        assert_eq!(m.map_plan(|p| Ok::<_, ()>(u32::from(p) + 1)).unwrap().plan, 8);
    }
}
