//! The job's life: completion, a stop asked for, the start deadline, and a job without
//! recovery that its first loss ends.

use super::*;

/// A job of nodes 10, 11, 12 without recovery: the others get `grace` after the first loss.
fn without_recovery(t0: Instant, grace: Duration) -> Controller {
    let mut c = running(3, 4, 2, t0);
    c.spec.on_loss = OnLoss::Stop { grace };
    c
}

#[test]
fn the_job_completes_when_every_rank_is_done_and_a_finished_worker_may_exit() {
    let t0 = Instant::now();
    let mut c = running(3, 4, 2, t0);
    assert!(c.decide(t0, Event::Done { node: 11 }).is_empty());
    // A finished worker exits and stops heartbeating: neither is a loss.
    assert!(c.decide(t0, Event::Exited { node: 11, status: "exit code 0".into() }).is_empty());
    c.decide(t0 + SEC / 2, Event::Heartbeat { node: 10 });
    c.decide(t0 + SEC / 2, Event::Heartbeat { node: 12 });
    assert!(c.decide(t0 + 3 * SEC / 2, Event::Done { node: 10 }).is_empty(), "11's lease is not checked any more");
    assert_eq!(c.member_state(11), MemberState::Member);
    assert_eq!(c.decide(t0 + 3 * SEC / 2, Event::Done { node: 12 }), vec![Command::Complete]);
    assert!(c.completed() && c.is_over() && !c.stopped());
    assert!(c.decide(t0 + 10 * SEC, Event::Exited { node: 10, status: "x".into() }).is_empty(), "over: nothing more happens");
    assert_eq!(c.deadline(), None);
}

#[test]
fn a_stop_request_asks_the_ranks_to_finish_once_per_epoch_and_no_move_of_its_own_follows() {
    let t0 = Instant::now();
    let mut c = running(3, 4, 2, t0);
    c.decide(t0, Event::Joined { workers: vec![20] });
    let out = c.decide(t0, Event::StopRequested { why: "SIGTERM".into() });
    assert_eq!(out, vec![Command::Finish { epoch: 0, nodes: vec![10, 11, 12] }]);
    assert!(c.decide(t0, Event::StopRequested { why: "SIGTERM".into() }).is_empty(), "asked once per epoch");
    // The joiner's wait runs out: the job does not pause to take it in, it is finishing.
    let late = t0 + 3 * SEC;
    for n in [10, 11, 12, 20] {
        c.decide(late, Event::Heartbeat { node: n });
    }
    assert!(c.decide(late, Event::Tick).is_empty());
    // A loss on the way moves the survivors; once the new epoch runs, they are asked again.
    let out = c.decide(late, Event::Exited { node: 12, status: "killed".into() });
    assert!(matches!(&out[..], [Command::Fence { .. }]), "{out:?}");
    for n in [10, 11] {
        c.decide(late, Event::StepFailed { node: n, epoch: 0, report: stop_report(&c, n, 5) });
    }
    let epoch = c.epoch();
    assert!(epoch > 0);
    let ranks = c.ranks().to_vec();
    for (i, &n) in ranks.iter().enumerate() {
        c.decide(late, Event::Listening { node: n, epoch, addr: format!("b{i}") });
    }
    let mut out = Vec::new();
    for &n in &ranks {
        out = c.decide(late, Event::Ready { node: n, epoch });
    }
    assert_eq!(out, vec![Command::Resume { epoch }, Command::Finish { epoch, nodes: ranks.clone() }]);
    for &n in &ranks {
        out = c.decide(late, Event::Done { node: n });
    }
    assert_eq!(out, vec![Command::Complete]);
}

/// What survivor `node` says when it stopped after `steps` steps.
fn stop_report(c: &Controller, node: NodeId, steps: u64) -> StopReport {
    StopReport { steps_done: steps, held: None, holds: c.planned_holdings(node).unwrap(), last: None, snapshots: vec![] }
}

#[test]
fn workers_not_all_ready_by_the_start_deadline_stop_the_job() {
    let t0 = Instant::now();
    let loads = vec![vec![1.0, 2.0, 3.0, 4.0]; 2];
    let plan = plan_model(&loads, ClusterShape::new(2, 1, 4).unwrap(), &PlanPolicy::trainer(2, None), None).unwrap();
    let mut c = Controller::new(JobSpec { start_within: 30 * SEC, lease: 100 * SEC, ..spec(4, 4) }, plan, vec![10, 11], t0);
    c.decide(t0, Event::Listening { node: 10, epoch: 0, addr: "a".into() });
    c.decide(t0, Event::Listening { node: 11, epoch: 0, addr: "b".into() });
    c.decide(t0, Event::Ready { node: 10, epoch: 0 });
    assert_eq!(c.next_wake(t0 + 29 * SEC), t0 + 30 * SEC, "the shell wakes the controller for the deadline");
    assert!(c.decide(t0 + 29 * SEC, Event::Tick).is_empty());
    let out = c.decide(t0 + 30 * SEC, Event::Tick);
    assert!(
        matches!(&out[..], [Command::Stop { reason }] if *reason == StopReason::NotStarted { within_s: 30, ready: 1, ranks: 2 }),
        "{out:?}"
    );
    assert!(c.stopped());
}

#[test]
fn a_started_job_has_no_start_deadline() {
    let t0 = Instant::now();
    let mut c = running(2, 4, 4, t0);
    for k in 1..200u32 {
        let t = t0 + SEC * k / 2;
        c.decide(t, Event::Heartbeat { node: 10 });
        c.decide(t, Event::Heartbeat { node: 11 });
    }
    assert!(c.running());
}

#[test]
fn without_recovery_the_first_loss_ends_the_job_once_the_others_have_ended() {
    let t0 = Instant::now();
    let mut c = without_recovery(t0, 10 * SEC);
    assert!(!c.recovers());
    let out = c.decide(t0, Event::Exited { node: 11, status: "killed by signal 9".into() });
    // The survivors are cut off from it (their steps fail now), and they end on their own.
    assert!(matches!(&out[..], [Command::Fence { ranks, nodes, .. }] if ranks == &[1] && nodes == &[10, 12]), "{out:?}");
    assert_eq!(c.phase_name(), "ending");
    assert_eq!(c.next_wake(t0), t0 + SEC / 4);
    assert!(c
        .decide(t0 + SEC / 10, Event::StepFailed { node: 10, epoch: 0, report: stop_report(&c, 10, 3) })
        .iter()
        .all(|c| matches!(c, Command::Fence { .. })));
    let out = c.decide(t0 + SEC / 5, Event::Exited { node: 12, status: "exit code 1".into() });
    assert!(
        matches!(&out[..], [.., Command::Stop { reason }] if reason.to_string() == "worker 11 lost: exited (killed by signal 9)"),
        "the first failure is the reason: {out:?}"
    );
    assert!(out.iter().all(|c| !matches!(c, Command::Reconfigure(_) | Command::Rollback { .. } | Command::Pause { .. })));
}

#[test]
fn without_recovery_survivors_that_do_not_end_are_given_up_after_the_grace() {
    let t0 = Instant::now();
    let mut c = without_recovery(t0, 5 * SEC);
    c.spec.lease = 100 * SEC;
    c.decide(t0, Event::Exited { node: 12, status: "exit code 101".into() });
    assert!(c.decide(t0 + 4 * SEC, Event::Tick).is_empty());
    assert_eq!(c.next_wake(t0 + 4 * SEC), t0 + 5 * SEC);
    let out = c.decide(t0 + 5 * SEC, Event::Tick);
    assert!(matches!(&out[..], [Command::Stop { reason }] if matches!(reason, StopReason::Lost { worker: 12, .. })), "{out:?}");
}

#[test]
fn without_a_placement_the_first_loss_ends_the_job_and_a_rendezvous_is_called_off() {
    let t0 = Instant::now();
    let mut c = Controller::unplanned(JobSpec { on_loss: OnLoss::Stop { grace: 5 * SEC }, ..spec(4, 2) }, 7, vec![10, 11, 12], t0);
    assert!(c.plan().is_none() && !c.recovers() && c.planned_holdings(10).is_none());
    c.decide(t0, Event::Listening { node: 10, epoch: 7, addr: "a".into() });
    let out = c.decide(t0, Event::Exited { node: 11, status: "exit code 2".into() });
    assert_eq!(out, vec![Command::Abandon { epoch: 7, nodes: vec![10, 12] }]);
    c.decide(t0, Event::Exited { node: 10, status: "exit code 1".into() });
    let out = c.decide(t0, Event::Exited { node: 12, status: "exit code 1".into() });
    assert!(matches!(&out[..], [Command::Stop { reason }] if matches!(reason, StopReason::Lost { worker: 11, .. })), "{out:?}");
}

#[test]
fn without_recovery_a_job_whose_ranks_all_finish_completes() {
    let t0 = Instant::now();
    let mut c = Controller::unplanned(JobSpec { on_loss: OnLoss::Stop { grace: SEC }, ..spec(4, 2) }, 0, vec![10, 11], t0);
    for (i, n) in [10, 11].into_iter().enumerate() {
        c.decide(t0, Event::Listening { node: n, epoch: 0, addr: format!("a{i}") });
    }
    c.decide(t0, Event::Ready { node: 10, epoch: 0 });
    assert_eq!(c.decide(t0, Event::Ready { node: 11, epoch: 0 }), vec![Command::Resume { epoch: 0 }]);
    c.decide(t0, Event::Done { node: 11 });
    assert_eq!(c.decide(t0, Event::Done { node: 10 }), vec![Command::Complete]);
}

#[test]
fn a_member_not_heard_from_yet_is_starting() {
    let t0 = Instant::now();
    let loads = vec![vec![1.0, 2.0, 3.0, 4.0]; 2];
    let plan = plan_model(&loads, ClusterShape::new(2, 1, 4).unwrap(), &PlanPolicy::trainer(2, None), None).unwrap();
    let mut c = Controller::new(spec(4, 4), plan, vec![10, 11], t0);
    assert_eq!((c.member_state(10), c.member_state(11)), (MemberState::Starting, MemberState::Starting));
    c.decide(t0, Event::Heartbeat { node: 10 });
    // Another worker's exit report is no word of its own.
    c.decide(t0, Event::Exited { node: 42, status: "x".into() });
    assert_eq!((c.member_state(10), c.member_state(11)), (MemberState::Member, MemberState::Starting));
    c.decide(t0, Event::Listening { node: 11, epoch: 0, addr: "b".into() });
    assert_eq!(c.member_state(11), MemberState::Member);
}

/// A node that joins as the job trains its last step is not taken in (a pause then would wait
/// for ranks that finish instead); and a pause for it that crossed the last step ends in the
/// job's completion, not a wait for reports that never come.
#[test]
fn a_join_at_the_job_s_end_neither_pauses_it_nor_keeps_it_from_completing() {
    let t0 = Instant::now();
    let loads = || vec![vec![4, 3, 2, 1]; 2];
    // The last step trained: the joiner waits its turn, which never comes.
    let mut c = running(2, 4, 3, t0);
    c.decide(t0, Event::StepDone { epoch: 0, step: 1000, steps: 1, loads: loads(), seconds: 0.1, moved: None });
    c.decide(t0, Event::Joined { workers: vec![20] });
    assert!(beat(&mut c, t0 + 3 * SEC).iter().all(|c| !matches!(c, Command::Pause { .. })), "no pause at the end");
    c.decide(t0 + 3 * SEC, Event::Done { node: 10 });
    assert_eq!(c.decide(t0 + 3 * SEC, Event::Done { node: 11 }), vec![Command::Complete]);

    // The pause went out a step before the end; the ranks finished the job instead.
    let mut c = running(2, 4, 3, t0);
    c.decide(t0, Event::StepDone { epoch: 0, step: 999, steps: 1, loads: loads(), seconds: 0.1, moved: None });
    c.decide(t0, Event::Joined { workers: vec![20] });
    let out = beat(&mut c, t0 + 2 * SEC);
    assert_eq!(out, vec![Command::Pause { epoch: 0, nodes: vec![10, 11] }]);
    c.decide(t0 + 2 * SEC, Event::StepDone { epoch: 0, step: 1000, steps: 1, loads: loads(), seconds: 0.1, moved: None });
    assert!(c.decide(t0 + 2 * SEC, Event::Done { node: 10 }).is_empty());
    assert_eq!(c.decide(t0 + 2 * SEC, Event::Done { node: 11 }), vec![Command::Complete]);
    assert!(c.completed());
}
