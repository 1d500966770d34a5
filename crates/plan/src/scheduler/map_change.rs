//! A move's replica map as it travels to a worker that has the one before: what changed.
//!
//! Why: every worker needs the whole replica map (it routes tokens to every rank), and a move
//! used to send it whole to each: at 1,024 nodes × 8 GPUs, 58 layers × 256 experts, 17.6 MB of
//! JSON per worker, 153 GB per move — for a node loss that changes 1,740 of 1.9 M replicas.
//! A worker that holds the previous map is sent how the ranks were renumbered and the holders of
//! the experts whose holders changed; it rebuilds the new map from its own, and the result is
//! validated as any map is.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::ReplicaMap;
use crate::error::PlanError;
use crate::ExpertId;

/// The replica map of a move: whole, or as changed from the map the worker has. Shared (`Arc`):
/// the controller sends the same one to every rank of a move.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum PlanUpdate {
    Whole { map: Arc<ReplicaMap> },
    Changed { change: Arc<ReplicaMapChange> },
}

impl PlanUpdate {
    /// The new map, given the one the worker has (`current`; only a change needs it).
    pub fn resolve(self, current: Option<&ReplicaMap>) -> Result<ReplicaMap, PlanError> {
        match self {
            PlanUpdate::Whole { map } => Ok(Arc::unwrap_or_clone(map)),
            PlanUpdate::Changed { change } => match current {
                Some(map) => map.changed_by(&change),
                None => Err(PlanError::invalid("replica map change", change.epoch, "this worker has no map to apply it to")),
            },
        }
    }
}

/// How the map whose [`ReplicaMap::digest`] is `from` becomes the map of `epoch`. (The map it
/// starts from is named by its content, not its epoch: a worker's first map carries the
/// placement's own epoch, the controller's the job's.)
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaMapChange {
    pub from: u64,
    pub epoch: u64,
    /// Ranks of the new map.
    pub ranks: usize,
    /// The new rank of each rank of the old map (None: it is not in the new one).
    pub renumber: Vec<Option<usize>>,
    /// Every expert whose holders are not the old ones renumbered, in (layer, expert) order.
    pub changed: Vec<ExpertChange>,
}

/// How one expert's holders differ from the old ones renumbered.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExpertChange {
    pub layer: usize,
    pub expert: ExpertId,
    /// Ranks that hold it now with a count they did not have: (rank, replicas).
    pub set: Vec<(usize, u32)>,
    /// Ranks that do not hold it any more.
    pub unset: Vec<usize>,
}

impl ReplicaMap {
    /// What turns this map into `next` when rank r of this one is rank `renumber[r]` of `next`
    /// (None: a renumbering that is not one-to-one into `next`'s ranks, or maps of other
    /// layers or experts).
    pub fn change_to(&self, next: &ReplicaMap, renumber: Vec<Option<usize>>) -> Option<ReplicaMapChange> {
        if next.layer_count() != self.layer_count()
            || next.experts() != self.experts()
            || !one_to_one(&renumber, self.ranks(), next.ranks())
        {
            return None;
        }
        let mut changed = Vec::new();
        for l in 0..self.layer_count() {
            for e in 0..self.experts() {
                let moved = renumbered(self.placed(l, e), &renumber);
                let now = next.placed(l, e);
                if moved != now {
                    let set = now.iter().copied().filter(|x| !moved.contains(x)).collect();
                    let unset = moved.iter().map(|&(r, _)| r).filter(|r| !now.iter().any(|x| x.0 == *r)).collect();
                    changed.push(ExpertChange { layer: l, expert: e, set, unset });
                }
            }
        }
        Some(ReplicaMapChange { from: self.digest(), epoch: next.epoch(), ranks: next.ranks(), renumber, changed })
    }

    /// A digest of the placement (ranks, and every expert's holders; not the epoch): FNV-1a
    /// over them, the same on every build.
    pub fn digest(&self) -> u64 {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        let mut eat = |x: u64| {
            for b in x.to_le_bytes() {
                h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
            }
        };
        eat(self.ranks() as u64);
        for l in 0..self.layer_count() {
            for e in 0..self.experts() {
                let held = self.placed(l, e);
                eat(held.len() as u64);
                for &(r, n) in held {
                    eat(r as u64);
                    eat(u64::from(n));
                }
            }
        }
        h
    }

    /// This map changed by `change` (which must start from this map's epoch), validated as a
    /// new map is.
    pub fn changed_by(&self, change: &ReplicaMapChange) -> Result<ReplicaMap, PlanError> {
        let bad = |value: String, reason: &str| PlanError::invalid("replica map change", value, reason);
        if change.from != self.digest() {
            return Err(bad(
                format!("to epoch {} from map {:016x}", change.epoch, change.from),
                &format!("this worker's map is {:016x}", self.digest()),
            ));
        }
        if !one_to_one(&change.renumber, self.ranks(), change.ranks) {
            return Err(bad(
                format!("a renumbering of {} ranks into {}", change.renumber.len(), change.ranks),
                &format!("needs one entry per rank of the old map ({}), each new rank once", self.ranks()),
            ));
        }
        let mut layers: Vec<Vec<Vec<(usize, u32)>>> = (0..self.layer_count())
            .map(|l| (0..self.experts()).map(|e| renumbered(self.placed(l, e), &change.renumber)).collect())
            .collect();
        let mut last = None;
        for c in &change.changed {
            let (l, e) = (c.layer, c.expert);
            if last.is_some_and(|x| x >= (l, e)) {
                return Err(bad(format!("layer {l} expert {e}"), "changes must be listed once each, in (layer, expert) order"));
            }
            last = Some((l, e));
            let held =
                layers.get_mut(l).and_then(|x| x.get_mut(e)).ok_or_else(|| bad(format!("layer {l} expert {e}"), "not in the map"))?;
            held.retain(|(r, _)| !c.unset.contains(r) && !c.set.iter().any(|x| x.0 == *r));
            held.extend(c.set.iter().copied());
            held.sort_unstable();
        }
        ReplicaMap::from_holders(change.epoch, change.ranks, layers)
    }
}

/// Whether `renumber` (one entry per old rank) sends distinct old ranks to distinct new ranks
/// below `new_ranks`.
fn one_to_one(renumber: &[Option<usize>], old_ranks: usize, new_ranks: usize) -> bool {
    let mut seen = vec![false; new_ranks];
    renumber.len() == old_ranks && renumber.iter().flatten().all(|&q| q < new_ranks && !std::mem::replace(&mut seen[q], true))
}

/// `held` with its ranks renumbered (those gone dropped), ranks ascending.
fn renumbered(held: &[(usize, u32)], renumber: &[Option<usize>]) -> Vec<(usize, u32)> {
    let mut out: Vec<(usize, u32)> = held.iter().filter_map(|&(r, n)| renumber.get(r).copied().flatten().map(|q| (q, n))).collect();
    out.sort_unstable();
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn map(epoch: u64, rows: Vec<Vec<Vec<u32>>>) -> ReplicaMap {
        ReplicaMap::new(epoch, rows).unwrap()
    }

    #[test]
    fn a_lost_rank_renumbers_the_rest_and_only_its_experts_change() {
        // Ranks 0, 1, 2; rank 1 is lost; expert 1 (held by 1 and 2) keeps rank 2 (now 1), and
        // expert 2 (only on rank 1) moves to rank 0.
        let old = map(3, vec![vec![vec![1, 0, 1], vec![0, 1, 1], vec![0, 1, 0]]]);
        let new = map(4, vec![vec![vec![1, 1], vec![0, 1], vec![1, 0]]]);
        let c = old.change_to(&new, vec![Some(0), None, Some(1)]).unwrap();
        assert_eq!(c.changed, vec![ExpertChange { layer: 0, expert: 2, set: vec![(0, 1)], unset: vec![] }]);
        assert_eq!(old.changed_by(&c).unwrap(), new);
        // Applied to another map, or with a renumbering that is not one-to-one: refused. The
        // epoch does not name the map: the same placement at another epoch takes it.
        assert!(new.changed_by(&c).unwrap_err().to_string().contains("this worker's map is"));
        assert_eq!(old.clone().with_epoch(9).changed_by(&c).unwrap(), new);
        let twice = ReplicaMapChange { renumber: vec![Some(0), None, Some(0)], ..c.clone() };
        assert!(old.changed_by(&twice).unwrap_err().to_string().contains("renumbering"));
        let at = |layer, expert, set: Vec<(usize, u32)>, unset: Vec<usize>| ExpertChange { layer, expert, set, unset };
        let unordered = ReplicaMapChange { changed: vec![at(0, 2, vec![(0, 1)], vec![]), at(0, 1, vec![(1, 1)], vec![])], ..c.clone() };
        assert!(old.changed_by(&unordered).unwrap_err().to_string().contains("order"));
        let outside = ReplicaMapChange { changed: vec![at(1, 0, vec![(0, 1)], vec![])], ..c.clone() };
        assert!(old.changed_by(&outside).unwrap_err().to_string().contains("not in the map"));
        // What it yields is validated as a map is (an expert left without a holder, a rank out
        // of range).
        let emptied = ReplicaMapChange { changed: vec![at(0, 1, vec![], vec![1])], ..c.clone() };
        assert!(old.changed_by(&emptied).unwrap_err().to_string().contains("no replica"));
        let beyond = ReplicaMapChange { changed: vec![at(0, 2, vec![(5, 1)], vec![])], ..c.clone() };
        assert!(old.changed_by(&beyond).unwrap_err().to_string().contains("ranks are below"));
        let emptied = ReplicaMapChange { changed: vec![at(0, 2, vec![], vec![])], ..c.clone() };
        assert!(old.changed_by(&emptied).unwrap_err().to_string().contains("no replica"));
        // It travels as JSON, and a whole map resolves without one.
        let back: PlanUpdate = serde_json::from_str(&serde_json::to_string(&PlanUpdate::Changed { change: Arc::new(c) }).unwrap()).unwrap();
        assert_eq!(back.resolve(Some(&old)).unwrap(), new);
        assert_eq!(PlanUpdate::Whole { map: Arc::new(new.clone()) }.resolve(None).unwrap(), new);
    }

    proptest! {
        /// Any two maps and any one-to-one renumbering: the change rebuilds the new map exactly.
        #[test]
        fn a_change_rebuilds_the_new_map(
            old_ranks in 1usize..6,
            new_ranks in 1usize..6,
            cells in proptest::collection::vec(0u32..3, 2 * 3 * 6 * 2),
            perm_seed in any::<u64>(),
        ) {
            let rows = |ranks: usize, off: usize| -> Vec<Vec<Vec<u32>>> {
                (0..2).map(|l| (0..3).map(|e| (0..ranks).map(|r| cells[(off + (l * 3 + e) * 6 + r) % cells.len()].max(u32::from(r == e % ranks))).collect()).collect()).collect()
            };
            let (old, new) = (map(1, rows(old_ranks, 0)), map(2, rows(new_ranks, 36)));
            // A one-to-one renumbering: a shuffled list of the new ranks, some old ranks dropped.
            let mut targets: Vec<usize> = (0..new_ranks).collect();
            let mut x = perm_seed;
            for i in (1..targets.len()).rev() {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                targets.swap(i, (x >> 33) as usize % (i + 1));
            }
            let renumber: Vec<Option<usize>> = (0..old_ranks).map(|r| if (perm_seed >> r) & 1 == 1 { None } else { targets.get(r).copied() }).collect();
            let c = old.change_to(&new, renumber).unwrap();
            prop_assert_eq!(old.changed_by(&c).unwrap(), new);
        }
    }
}
