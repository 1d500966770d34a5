//! The controller's messages to workers ([`LauncherMessage`]) as node agents carry them: the
//! hub encodes one once (protobuf; compressed when long) for every node it goes to, and the
//! agent decodes it, checks it — a plan that is no replica map, a rank beyond this machine's
//! words, a move with no plan — and writes it to each worker's stdin.

use std::sync::Arc;

use lazarus_plan::{ExpertChange, Move, PlanUpdate, RankTransfer, ReplicaMap, ReplicaMapChange};
use prost::Message;

use super::{bad, word, words, BadMessage};
use crate::messages::{LauncherMessage, MoveOrder};
use crate::proto::{self, launcher_message as lm};

/// The bytes of `message` as the agents' channel carries it.
pub fn encode(message: &LauncherMessage) -> Vec<u8> {
    to_proto(message).encode_to_vec()
}

/// A message from the controller's bytes, checked.
pub fn decode(bytes: &[u8]) -> Result<LauncherMessage, BadMessage> {
    let message = proto::LauncherMessage::decode(bytes).map_err(|e| bad("message", format!("not protobuf: {e}")))?;
    from_proto(message)
}

/// The message a `WorkerInput` carries: decompressed if it came so, decoded and checked.
pub fn decode_input(input: &proto::WorkerInput) -> Result<LauncherMessage, BadMessage> {
    if !input.deflated {
        return decode(&input.message);
    }
    decode(&crate::inflate_bytes(&input.message).map_err(|e| bad("message", e))?)
}

pub fn to_proto(message: &LauncherMessage) -> proto::LauncherMessage {
    let message = match message {
        LauncherMessage::Addrs { epoch, addrs } => lm::Message::Addrs(lm::Addrs { epoch: *epoch, addrs: addrs.clone() }),
        LauncherMessage::Reconfigure { commit_to, to } => {
            lm::Message::Reconfigure(lm::Reconfigure { commit_to: *commit_to, to: Some(move_order(to)) })
        }
        LauncherMessage::Rollback { to_step, to } => lm::Message::Rollback(lm::Rollback { to_step: *to_step, to: Some(move_order(to)) }),
        LauncherMessage::Transfers { epoch, transfers } => {
            lm::Message::Transfers(lm::Transfers { epoch: *epoch, transfers: transfers.iter().map(rank_transfer).collect() })
        }
        LauncherMessage::Abandon { epoch } => lm::Message::Abandon(*epoch),
        LauncherMessage::Fence { epoch, ranks } => {
            lm::Message::Fence(lm::Fence { epoch: *epoch, ranks: ranks.iter().map(|&r| r as u64).collect() })
        }
        LauncherMessage::Pause { epoch } => lm::Message::Pause(*epoch),
        LauncherMessage::Finish { epoch } => lm::Message::Finish(*epoch),
    };
    proto::LauncherMessage { message: Some(message) }
}

pub fn from_proto(message: proto::LauncherMessage) -> Result<LauncherMessage, BadMessage> {
    let order = |to: Option<proto::MoveOrder>| to.ok_or_else(|| bad("to", "missing")).and_then(move_order_of);
    Ok(match message.message.ok_or_else(|| bad("message", "missing"))? {
        lm::Message::Addrs(a) => LauncherMessage::Addrs { epoch: a.epoch, addrs: a.addrs },
        lm::Message::Reconfigure(r) => LauncherMessage::Reconfigure { commit_to: r.commit_to, to: order(r.to)? },
        lm::Message::Rollback(r) => LauncherMessage::Rollback { to_step: r.to_step, to: order(r.to)? },
        lm::Message::Transfers(t) => {
            LauncherMessage::Transfers { epoch: t.epoch, transfers: t.transfers.iter().map(rank_transfer_of).collect::<Result<_, _>>()? }
        }
        lm::Message::Abandon(epoch) => LauncherMessage::Abandon { epoch },
        lm::Message::Fence(f) => LauncherMessage::Fence { epoch: f.epoch, ranks: words("ranks", &f.ranks)? },
        lm::Message::Pause(epoch) => LauncherMessage::Pause { epoch },
        lm::Message::Finish(epoch) => LauncherMessage::Finish { epoch },
    })
}

fn move_order(m: &MoveOrder) -> proto::MoveOrder {
    let (workers, m) = (&m.workers, &m.change);
    proto::MoveOrder {
        epoch: m.epoch,
        workers: workers.clone(),
        plan: Some(match &m.plan {
            PlanUpdate::Whole { map } => proto::move_order::Plan::Whole(replica_map(map)),
            PlanUpdate::Changed { change } => proto::move_order::Plan::Changed(map_change(change)),
        }),
        transfers: m.transfers.iter().map(rank_transfer).collect(),
        catch_up: m.catch_up.iter().map(|&(l, e, t)| proto::CatchUp { layer: l as u64, expert: e as u64, tokens: t }).collect(),
        joining: m.joining.iter().map(|&r| r as u64).collect(),
        leaving: m.leaving.iter().map(|&r| r as u64).collect(),
        hold: m.hold,
    }
}

fn move_order_of(m: proto::MoveOrder) -> Result<MoveOrder, BadMessage> {
    let plan = match m.plan.ok_or_else(|| bad("plan", "missing"))? {
        proto::move_order::Plan::Whole(map) => PlanUpdate::Whole { map: Arc::new(replica_map_of(map)?) },
        proto::move_order::Plan::Changed(change) => PlanUpdate::Changed { change: Arc::new(map_change_of(change)?) },
    };
    let change = Move {
        epoch: m.epoch,
        plan,
        transfers: m.transfers.iter().map(rank_transfer_of).collect::<Result<_, _>>()?,
        catch_up: m
            .catch_up
            .iter()
            .map(|c| Ok((word("catch_up.layer", c.layer)?, word("catch_up.expert", c.expert)?, c.tokens)))
            .collect::<Result<_, _>>()?,
        joining: words("joining", &m.joining)?,
        leaving: words("leaving", &m.leaving)?,
        hold: m.hold,
    };
    Ok(MoveOrder { workers: m.workers, change })
}

fn rank_transfer(t: &RankTransfer) -> proto::RankTransfer {
    proto::RankTransfer { layer: t.layer as u64, expert: t.expert as u64, from: t.from as u64, to: t.to as u64 }
}

fn rank_transfer_of(t: &proto::RankTransfer) -> Result<RankTransfer, BadMessage> {
    Ok(RankTransfer {
        layer: word("transfers.layer", t.layer)?,
        expert: word("transfers.expert", t.expert)?,
        from: word("transfers.from", t.from)?,
        to: word("transfers.to", t.to)?,
    })
}

fn holders(placed: &[(usize, u32)]) -> proto::Holders {
    proto::Holders { ranks: placed.iter().map(|&(r, _)| r as u64).collect(), replicas: placed.iter().map(|&(_, n)| n).collect() }
}

fn holders_of(field: &'static str, h: &proto::Holders) -> Result<Vec<(usize, u32)>, BadMessage> {
    if h.ranks.len() != h.replicas.len() {
        return Err(bad(field, format!("{} ranks with {} replica counts", h.ranks.len(), h.replicas.len())));
    }
    h.ranks.iter().zip(&h.replicas).map(|(&r, &n)| Ok((word(field, r)?, n))).collect()
}

pub(super) fn replica_map(map: &ReplicaMap) -> proto::ReplicaMap {
    proto::ReplicaMap {
        epoch: map.epoch(),
        ranks: map.ranks() as u64,
        layers: (0..map.layer_count())
            .map(|l| proto::replica_map::Layer { experts: (0..map.experts()).map(|e| holders(map.placed(l, e))).collect() })
            .collect(),
    }
}

/// A replica map, checked as every map is on construction ([`ReplicaMap::from_holders`]).
pub(super) fn replica_map_of(map: proto::ReplicaMap) -> Result<ReplicaMap, BadMessage> {
    let layers = map
        .layers
        .iter()
        .map(|layer| layer.experts.iter().map(|h| holders_of("plan", h)).collect::<Result<Vec<_>, _>>())
        .collect::<Result<Vec<_>, _>>()?;
    ReplicaMap::from_holders(map.epoch, word("plan.ranks", map.ranks)?, layers).map_err(|e| bad("plan", e.to_string()))
}

fn map_change(c: &ReplicaMapChange) -> proto::ReplicaMapChange {
    proto::ReplicaMapChange {
        from: c.from,
        epoch: c.epoch,
        ranks: c.ranks as u64,
        renumber: c.renumber.iter().map(|r| r.map_or(-1, |r| r as i64)).collect(),
        changed: c
            .changed
            .iter()
            .map(|x| proto::ExpertChange {
                layer: x.layer as u64,
                expert: x.expert as u64,
                set: Some(holders(&x.set)),
                unset: x.unset.iter().map(|&r| r as u64).collect(),
            })
            .collect(),
    }
}

fn map_change_of(c: proto::ReplicaMapChange) -> Result<ReplicaMapChange, BadMessage> {
    let renumber = c
        .renumber
        .iter()
        .map(|&r| match r {
            -1 => Ok(None),
            r if r >= 0 => word("plan.renumber", r as u64).map(Some),
            r => Err(bad("plan.renumber", format!("{r} is no rank"))),
        })
        .collect::<Result<_, _>>()?;
    let changed = c
        .changed
        .iter()
        .map(|x| {
            Ok(ExpertChange {
                layer: word("plan.changed.layer", x.layer)?,
                expert: word("plan.changed.expert", x.expert)?,
                set: x.set.as_ref().map(|h| holders_of("plan.changed.set", h)).transpose()?.unwrap_or_default(),
                unset: words("plan.changed.unset", &x.unset)?,
            })
        })
        .collect::<Result<_, _>>()?;
    Ok(ReplicaMapChange { from: c.from, epoch: c.epoch, ranks: word("plan.ranks", c.ranks)?, renumber, changed })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(epoch: u64) -> ReplicaMap {
        // 2 layers x 3 experts over 4 ranks.
        ReplicaMap::new(
            epoch,
            vec![vec![vec![1, 0, 2, 0], vec![0, 1, 0, 1], vec![1, 1, 0, 0]], vec![vec![0, 0, 1, 1], vec![2, 0, 0, 0], vec![0, 1, 1, 0]]],
        )
        .unwrap()
    }

    fn order(plan: PlanUpdate) -> MoveOrder {
        let transfers = vec![RankTransfer { layer: 1, expert: 2, from: 0, to: 3 }];
        MoveOrder {
            workers: vec![4, 5, 7, 8],
            change: Move { catch_up: vec![(0, 1, 300)], joining: vec![3], hold: true, ..Move::new(9, plan, transfers) },
        }
    }

    fn every_message() -> Vec<LauncherMessage> {
        let next =
            ReplicaMap::new(9, vec![vec![vec![1, 2, 0], vec![0, 1, 1], vec![1, 0, 1]], vec![vec![0, 1, 1], vec![1, 1, 0], vec![0, 1, 1]]])
                .unwrap();
        let change = map(8).change_to(&next, vec![Some(0), None, Some(1), Some(2)]).expect("a one-to-one renumbering");
        vec![
            LauncherMessage::Addrs { epoch: 3, addrs: vec!["10.0.0.1:4000".into(), "10.0.0.2:4000".into()] },
            LauncherMessage::Reconfigure { commit_to: 41, to: order(PlanUpdate::Whole { map: Arc::new(map(9)) }) },
            LauncherMessage::Reconfigure { commit_to: 41, to: order(PlanUpdate::Changed { change: Arc::new(change) }) },
            LauncherMessage::Rollback { to_step: Some(40), to: order(PlanUpdate::Whole { map: Arc::new(map(9)) }) },
            LauncherMessage::Rollback { to_step: None, to: order(PlanUpdate::Whole { map: Arc::new(map(9)) }) },
            LauncherMessage::Transfers { epoch: 9, transfers: vec![RankTransfer { layer: 0, expert: 1, from: 2, to: 0 }] },
            LauncherMessage::Abandon { epoch: 4 },
            LauncherMessage::Fence { epoch: 4, ranks: vec![1, 3] },
            LauncherMessage::Pause { epoch: 5 },
            LauncherMessage::Finish { epoch: 6 },
        ]
    }

    #[test]
    fn every_message_comes_back_as_it_was_sent() {
        for message in every_message() {
            let got = decode(&encode(&message)).unwrap();
            assert_eq!(serde_json::to_value(&got).unwrap(), serde_json::to_value(&message).unwrap(), "{message:?}");
        }
    }

    #[test]
    fn a_message_that_is_not_one_is_refused_naming_its_field() {
        assert_eq!(decode(&[0xff, 0xff, 0xff]).unwrap_err().field, "message");
        assert_eq!(from_proto(proto::LauncherMessage { message: None }).unwrap_err().field, "message");
        let reconfigure = |to: Option<proto::MoveOrder>| proto::LauncherMessage {
            message: Some(lm::Message::Reconfigure(lm::Reconfigure { commit_to: 1, to })),
        };
        assert_eq!(from_proto(reconfigure(None)).unwrap_err().field, "to");
        let mut m = move_order(&order(PlanUpdate::Whole { map: Arc::new(map(9)) }));
        m.plan = None;
        assert_eq!(from_proto(reconfigure(Some(m.clone()))).unwrap_err().field, "plan");
        // A map whose expert is held nowhere, or whose arrays disagree: no map.
        let mut whole = replica_map(&map(9));
        whole.layers[0].experts[1] = proto::Holders::default();
        m.plan = Some(proto::move_order::Plan::Whole(whole.clone()));
        assert_eq!(from_proto(reconfigure(Some(m.clone()))).unwrap_err().field, "plan");
        whole.layers[0].experts[1] = proto::Holders { ranks: vec![1, 3], replicas: vec![1] };
        m.plan = Some(proto::move_order::Plan::Whole(whole));
        assert_eq!(from_proto(reconfigure(Some(m))).unwrap_err().field, "plan");
        let mut change = map_change(&map(8).change_to(&map(9), vec![Some(0), Some(1), Some(2), Some(3)]).unwrap());
        change.renumber[0] = -7;
        assert_eq!(map_change_of(change).unwrap_err().field, "plan.renumber");
    }
}
