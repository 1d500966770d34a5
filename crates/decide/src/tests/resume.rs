//! A job taken back by a new controller: rebuilt from the saved [`JobState`] and what the
//! workers report, it moves to the next epoch with every state kept.

use super::*;

/// A job of 4 single-worker nodes after a few steps, and its saved state.
fn saved(t0: Instant) -> (Controller, JobState) {
    let mut c = running(4, 4, 3, t0);
    c.decide(t0, even_step(7));
    c.decide(t0, Event::Checkpointed { step: 5 });
    let state = c.job_state().expect("a planned job");
    (c, state)
}

fn paused(c: &Controller, node: NodeId, steps_done: u64) -> StopReport {
    StopReport { steps_done, held: None, holds: c.planned_holdings(node).unwrap(), last: None, snapshots: vec![] }
}

/// The job [`saved`] at `t0` and a new controller that takes it back 30 s later (with step
/// `last_logged` in the log it found), with that time.
fn taken_back(t0: Instant, last_logged: Option<u64>) -> (Controller, Controller, Instant) {
    let (old, state) = saved(t0);
    let t1 = t0 + 30 * SEC;
    (old, Controller::resumed(spec(4, 3), state, last_logged, t1, 10 * SEC).unwrap(), t1)
}

#[test]
fn the_saved_state_round_trips_through_json() {
    let t0 = Instant::now();
    let (_, state) = saved(t0);
    assert_eq!((state.epoch, state.ranks.clone(), state.checkpoint, state.last_step), (0, vec![10, 11, 12, 13], Some(5), 7));
    let text = serde_json::to_string(&state).unwrap();
    assert_eq!(serde_json::from_str::<JobState>(&text).unwrap(), state);
}

#[test]
fn a_new_controller_keeps_the_plan_and_moves_every_member_to_the_next_epoch_without_transfers() {
    let t0 = Instant::now();
    let (old, mut c, t1) = taken_back(t0, Some(8));
    assert!(c.resuming() && c.phase_name() == "collecting");
    assert_eq!((c.last_step(), c.checkpoint(), c.epoch()), (8, Some(5), 0));
    // Silence within the re-attach window loses nobody.
    assert!(c.decide(t1 + 5 * SEC, Event::Tick).is_empty());
    // Every member paused after step 8; one of them was told of nothing newer.
    for n in [10, 11, 12] {
        assert!(c.decide(t1 + 5 * SEC, Event::Paused { node: n, epoch: 0, report: paused(&old, n, 8) }).is_empty());
    }
    let out = c.decide(t1 + 5 * SEC, Event::Paused { node: 13, epoch: 0, report: paused(&old, 13, 8) });
    let [Command::Reconfigure(m)] = &out[..] else { panic!("{out:?}") };
    assert_eq!((m.change.epoch, m.commit_to, m.cause), (1, 8, MoveCause::Controller));
    assert!(m.change.transfers.is_empty(), "every member holds what it held: {:?}", m.change.transfers);
    let mut ranks = m.ranks.clone();
    ranks.sort_unstable();
    assert_eq!(ranks, vec![10, 11, 12, 13]);
    assert!(!c.resuming());
    assert_eq!(c.reconfigurations(), 1);
}

#[test]
fn a_member_that_never_comes_back_is_lost_at_the_end_of_the_window_and_the_job_replans_without_it() {
    let t0 = Instant::now();
    let (old, mut c, t1) = taken_back(t0, None);
    for n in [10, 11, 13] {
        c.decide(t1 + SEC, Event::Paused { node: n, epoch: 0, report: paused(&old, n, 7) });
    }
    // The survivors keep their leases by heartbeats; node 12 is never heard from.
    // (Every quarter lease: a longer gap would be a stall of the controller, which extends leases.)
    let mut out = Vec::new();
    for q in 5..=44u32 {
        for n in [10, 11, 13] {
            out.extend(c.decide(t1 + SEC * q / 4, Event::Heartbeat { node: n }));
        }
    }
    assert!(out.iter().any(|x| matches!(x, Command::Kill { node: 12, .. })), "{out:?}");
    let Some(Command::Reconfigure(m)) = out.iter().find(|x| matches!(x, Command::Reconfigure(_))) else { panic!("{out:?}") };
    assert_eq!((m.change.epoch, m.commit_to, m.ranks.len()), (1, 7, 3));
    assert!(!m.ranks.contains(&12));
}

#[test]
fn reports_of_the_epoch_before_the_saved_one_count_and_a_half_committed_move_commits() {
    let t0 = Instant::now();
    // The old controller lost node 13 and decided a move to epoch 1, saved it, and was lost
    // before node 12 heard of it: 10 and 11 committed step 8 and stopped in epoch 1's
    // rendezvous, 12 still holds step 8 uncommitted in epoch 0.
    let mut old = running(4, 4, 3, t0);
    old.decide(t0, even_step(8));
    old.decide(t0, Event::Exited { node: 13, status: "killed".into() });
    for n in [10, 11, 12] {
        let r = StopReport { steps_done: 7, held: Some(8), holds: old.planned_holdings(n).unwrap(), last: None, snapshots: vec![] };
        old.decide(t0, Event::StepFailed { node: n, epoch: 0, report: r });
    }
    assert_eq!(old.epoch(), 1);
    let state = old.job_state().unwrap();
    assert_eq!(state.ranks.len(), 3);
    let mut c = Controller::resumed(spec(4, 3), state, Some(8), t0 + 5 * SEC, 10 * SEC).unwrap();
    let holds = |n| old.planned_holdings(n).unwrap();
    let r = |n, steps_done, held| StopReport { steps_done, held, holds: holds(n), last: None, snapshots: vec![] };
    c.decide(t0 + 6 * SEC, Event::StepFailed { node: 10, epoch: 1, report: r(10, 8, None) });
    c.decide(t0 + 6 * SEC, Event::StepFailed { node: 11, epoch: 1, report: r(11, 8, None) });
    // A report of an epoch beyond the saved one is no one's: ignored.
    assert!(c.decide(t0 + 6 * SEC, Event::StepFailed { node: 12, epoch: 9, report: r(12, 7, Some(8)) }).is_empty());
    let out = c.decide(t0 + 6 * SEC, Event::StepFailed { node: 12, epoch: 0, report: r(12, 7, Some(8)) });
    let [Command::Reconfigure(m)] = &out[..] else { panic!("{out:?}") };
    assert_eq!((m.change.epoch, m.commit_to), (2, 8), "the held step is committed, not run twice");
}

#[test]
fn a_saved_state_that_does_not_fit_the_job_is_refused_naming_the_field() {
    let t0 = Instant::now();
    let (_, state) = saved(t0);
    let refused = |s: JobState, sp: JobSpec| Controller::resumed(sp, s, None, t0, SEC).err().map(|e| e.field);
    assert_eq!(refused(JobState { plan: "{".into(), ..state.clone() }, spec(4, 3)), Some("plan"));
    assert_eq!(refused(JobState { ranks: vec![], ..state.clone() }, spec(4, 3)), Some("ranks"));
    assert_eq!(refused(JobState { ranks: vec![10, 10, 11, 12], ..state.clone() }, spec(4, 3)), Some("ranks"));
    assert_eq!(refused(JobState { ranks: vec![10, 11, 12], ..state.clone() }, spec(4, 3)), Some("plan"));
    assert_eq!(refused(JobState { node_of: vec![], ..state.clone() }, spec(4, 3)), Some("node_of"));
    assert_eq!(refused(state.clone(), spec(5, 3)), Some("plan"), "another job's experts");
    assert_eq!(refused(JobState { first_epoch: 3, ..state.clone() }, spec(4, 3)), Some("epoch"));
    assert!(refused(state, spec(4, 3)).is_none());
}

/// Found by the soak: once a member of a job taken back is heard from, a silence of a lease
/// loses it, as in any job — the re-attach window is for members not heard from yet.
#[test]
fn a_member_heard_from_after_the_takeover_is_lost_by_its_usual_lease() {
    let t0 = Instant::now();
    let (old, mut c, t1) = taken_back(t0, Some(8));
    c.decide(t1, Event::Tick);
    for n in [10, 11, 12, 13] {
        c.decide(t1, Event::Paused { node: n, epoch: 0, report: paused(&old, n, 8) });
    }
    assert_eq!(c.epoch(), 1, "moved");
    // Node 13 falls silent; the others keep beating every quarter lease.
    let mut out = Vec::new();
    for q in 1..=8u32 {
        for n in [10, 11, 12] {
            out.extend(c.decide(t1 + SEC * q / 4, Event::Heartbeat { node: n }));
        }
    }
    assert!(out.iter().any(|x| matches!(x, Command::Kill { node: 13, .. })), "lost within about a lease, not at the window's end: {out:?}");
}
