use super::*;
use crate::fleet::{Fleet, FleetEvent};
use lazarus_protocol::handshake::hello_context;
use lazarus_protocol::relay::start::slot_to_proto;
use lazarus_protocol::LauncherMessage;
use lazarus_setting::Setting;

const SECRET: u128 = 0x0123_4567_89ab_cdef_0011_2233_4455_6677;

fn hub(world: usize, g: usize) -> (Arc<AgentHub>, Receiver<HubInput>) {
    elastic_hub(world, g, world)
}

fn elastic_hub(world: usize, g: usize, max_workers: usize) -> (Arc<AgentHub>, Receiver<HubInput>) {
    AgentHub::new("job-7".into(), SECRET, world, g, max_workers, 100, Duration::from_secs(1), Duration::from_millis(200))
}

/// Joiners' spec lines name their worker id and host; their job is "standby".
fn joiner() -> Joiner {
    Joiner { job: "standby".into(), spec: Box::new(|id, host, epoch| slot_to_proto(id, id + 1, epoch, 1.0, host, false)) }
}

/// The job every worker of these tests runs.
fn job() -> prost::bytes::Bytes {
    "{\"the\":\"job\"}".into()
}

/// The controller's challenge in these tests.
const CHALLENGE: [u8; auth::NONCE] = [9; auth::NONCE];

/// An agent's hello that answers [`CHALLENGE`] with its proof of `secret`.
fn hello(secret: u128, gpus: u32, host: &str) -> AgentHello {
    let nonce = auth::nonce().unwrap().to_vec();
    let mut h = AgentHello { proof: Vec::new(), nonce, gpus, host: host.into(), pid: 1, rejoin: None };
    h.proof = auth::prove(secret, &hello_context(&h), &CHALLENGE, &h.nonce).to_vec();
    h
}

fn link() -> UnboundedSender<Result<ControllerMessage, Status>> {
    tokio::sync::mpsc::unbounded_channel().0
}

fn report(epoch: u64, slot: u32, ev: &WorkerEvent) -> AgentMessage {
    AgentMessage {
        job_id: "job-7".into(),
        epoch,
        body: Some(agent_message::Body::Report(lazarus_protocol::relay::reports::to_proto(slot as usize, ev).unwrap())),
    }
}

#[test]
fn agents_without_the_secret_or_room_are_refused_with_the_reason() {
    let (h, _rx) = hub(6, 2);
    let wrong = h.admit(&hello(SECRET ^ 1, 2, "10.0.0.2"), &CHALLENGE, link()).unwrap_err();
    assert_eq!(wrong.code(), tonic::Code::PermissionDenied);
    let garbled = AgentHello { proof: b"xyz".to_vec(), ..hello(SECRET, 2, "10.0.0.2") };
    assert_eq!(h.admit(&garbled, &CHALLENGE, link()).unwrap_err().code(), tonic::Code::PermissionDenied);
    // A hello overheard in another session does not answer this one's challenge, and one
    // whose node was changed on the way proves nothing.
    let overheard = hello(SECRET, 2, "10.0.0.2");
    assert_eq!(h.admit(&overheard, &[1; auth::NONCE], link()).unwrap_err().code(), tonic::Code::PermissionDenied);
    let altered = AgentHello { host: "10.0.0.66".into(), ..overheard };
    assert_eq!(h.admit(&altered, &CHALLENGE, link()).unwrap_err().code(), tonic::Code::PermissionDenied);
    let none = h.admit(&hello(SECRET, 0, "10.0.0.2"), &CHALLENGE, link()).unwrap_err();
    assert!(none.code() == tonic::Code::InvalidArgument && none.message().contains("gpus: 0"), "{none:?}");
    let host = h.admit(&hello(SECRET, 2, "node-a"), &CHALLENGE, link()).unwrap_err();
    assert!(host.code() == tonic::Code::InvalidArgument && host.message().contains("node-a"), "{host:?}");
    // Every node of a job has its GPUs per node.
    let odd = h.admit(&hello(SECRET, 3, "10.0.0.2"), &CHALLENGE, link()).unwrap_err();
    assert!(odd.code() == tonic::Code::InvalidArgument && odd.message().contains("have 2 each"), "{odd:?}");
    for (i, host) in ["10.0.0.2", "10.0.0.3", "10.0.0.4"].into_iter().enumerate() {
        assert_eq!(h.admit(&hello(SECRET, 2, host), &CHALLENGE, link()).unwrap(), i as u64);
    }
    let full = h.admit(&hello(SECRET, 2, "10.0.0.5"), &CHALLENGE, link()).unwrap_err();
    assert!(full.code() == tonic::Code::ResourceExhausted && full.message().contains("room for 0 more"), "{full:?}");
    assert_eq!(h.attached_workers(), 6);
}

#[test]
fn a_started_job_at_its_most_workers_takes_no_more_agents_and_numbers_workers_by_arrival() {
    let (h, rx) = hub(4, 2);
    h.admit(&hello(SECRET, 2, "10.0.0.2"), &CHALLENGE, link()).unwrap();
    h.admit(&hello(SECRET, 2, "10.0.0.3"), &CHALLENGE, link()).unwrap();
    let fleet = h.start(rx, job(), |rank, host| slot_to_proto(rank, 4, 0, 1.0, host, false), joiner()).unwrap();
    assert_eq!(fleet.ranks_of(0), vec![0, 1]);
    assert_eq!(fleet.ranks_of(1), vec![2, 3]);
    let late = h.admit(&hello(SECRET, 2, "10.0.0.4"), &CHALLENGE, link()).unwrap_err();
    assert!(late.code() == tonic::Code::ResourceExhausted && late.message().contains(&Setting::MaxWorkers.to_string()), "{late:?}");
}

#[test]
fn an_agent_that_attaches_to_a_running_job_gets_new_worker_ids_and_standby_specs() {
    let (h, rx) = elastic_hub(2, 2, 4);
    h.admit(&hello(SECRET, 2, "10.0.0.2"), &CHALLENGE, link()).unwrap();
    let mut fleet = h.start(rx, job(), |rank, host| slot_to_proto(rank, 4, 0, 1.0, host, false), joiner()).unwrap();
    // Room for one more node of 2 after the start, not two.
    let (tx, mut from_controller) = tokio::sync::mpsc::unbounded_channel();
    let agent = h.admit(&hello(SECRET, 2, "10.0.0.9"), &CHALLENGE, tx).unwrap();
    assert_eq!(h.admit(&hello(SECRET, 2, "10.0.0.8"), &CHALLENGE, link()).unwrap_err().code(), tonic::Code::ResourceExhausted);
    h.input(HubInput::Joined { agent });
    let joined = fleet.next_event(Duration::from_millis(50));
    assert!(matches!(&joined, Some(FleetEvent::Joined { workers }) if workers == &[2, 3]), "{joined:?}");
    assert!(fleet.next_event(Duration::from_millis(20)).is_none(), "told once");
    assert_eq!(fleet.ranks_of(agent), vec![2, 3]);
    let Ok(Ok(m)) = from_controller.try_recv() else { panic!("the agent is sent its workers' specs") };
    let Some(controller_message::Body::Start(start)) = m.body else { panic!("{m:?}") };
    let slots: Vec<(u64, u64, &str, u64)> = start.workers.iter().map(|w| (w.rank, w.world, w.bind.as_str(), w.epoch)).collect();
    assert_eq!(slots, vec![(2, 3, "10.0.0.9", 100), (3, 4, "10.0.0.9", 100)], "standby workers numbered after every worker so far");
    assert_eq!((start.job.as_ref(), start.standby), (&b"standby"[..], true), "the joiners' job, once for the node");
    // Its workers' reports reach the loop under their ids.
    assert!(matches!(h.take(agent, report(100, 1, &WorkerEvent::Heartbeat)), Some(HubInput::Report { slot: 1, .. })));
}

#[test]
fn reports_are_checked_before_the_controller_sees_them() {
    let (h, rx) = hub(2, 2);
    h.admit(&hello(SECRET, 2, "10.0.0.2"), &CHALLENGE, link()).unwrap();
    let mut fleet = h.start(rx, job(), |rank, _| slot_to_proto(rank, 4, 0, 1.0, "", false), joiner()).unwrap();
    let beat = WorkerEvent::Heartbeat;
    // A slot the agent does not have, and a line that is not a report: dropped.
    assert!(h.take(0, report(100, 2, &beat)).is_none());
    let mut junk = report(100, 0, &beat);
    if let Some(agent_message::Body::Report(r)) = &mut junk.body {
        r.event = Some(proto::worker_report::Event::Failed(proto::worker_report::Failed { kind: 42, message: "meltdown".into() }));
    }
    assert!(h.take(0, junk).is_none());
    assert!(matches!(h.take(0, report(100, 1, &beat)), Some(HubInput::Report { slot: 1, .. })));
    // Once the controller moved rank 1 to epoch 101, its reports of epoch 100 are stale —
    // except news that holds whatever the epoch.
    fleet.send(1, &LauncherMessage::Abandon { epoch: 101 }).unwrap();
    let ready = WorkerEvent::Ready { pid: 9, epoch: 100, moved: None };
    assert!(h.take(0, report(100, 1, &ready)).is_none());
    assert!(h.take(0, report(101, 1, &ready)).is_some());
    assert!(h.take(0, report(100, 1, &beat)).is_some());
    // Rank 0 was not moved: its epoch-100 reports stand.
    assert!(h.take(0, report(100, 0, &ready)).is_some());
}

#[test]
fn staleness_is_about_reports_bound_to_an_epoch() {
    let step_failed = WorkerEvent::StepFailed {
        epoch: 3,
        steps_done: 1,
        held: None,
        holds: vec![],
        kind: lazarus_protocol::FailureKind::PeerLost,
        message: String::new(),
        last: None,
        snapshots: vec![],
    };
    assert!(stale(3, 4, &step_failed));
    assert!(!stale(4, 4, &step_failed));
    assert!(!stale(3, 4, &WorkerEvent::Heartbeat));
    assert!(!stale(3, 4, &WorkerEvent::Done { checkpoint: None }));
    assert!(stale(3, 4, &WorkerEvent::Listening { addr: "1.2.3.4:5".into(), epoch: 3 }));
}

#[test]
fn an_agent_that_is_gone_takes_all_its_workers_with_it() {
    let (h, rx) = hub(4, 2);
    h.admit(&hello(SECRET, 2, "10.0.0.2"), &CHALLENGE, link()).unwrap();
    h.admit(&hello(SECRET, 2, "10.0.0.3"), &CHALLENGE, link()).unwrap();
    let mut fleet = h.start(rx, job(), |rank, _| slot_to_proto(rank, 4, 0, 1.0, "", false), joiner()).unwrap();
    h.drop_agent(1, "its stream ended");
    let mut exits: Vec<usize> = (0..2)
        .filter_map(|_| fleet.next_event(Duration::from_millis(200)))
        .map(|ev| match ev {
            FleetEvent::Exited { rank } => rank,
            other => panic!("{other:?}"),
        })
        .collect();
    exits.sort_unstable();
    assert_eq!(exits, vec![2, 3]);
    assert!(fleet.exit_status(2).contains("agent 1 is gone: its stream ended"));
    assert!(fleet.next_event(Duration::from_millis(20)).is_none(), "each exit once");
    // Heard from again (a partition healed): its reports, even of the current epoch, and its
    // exits are refused — its workers are no longer the job's.
    let ready = WorkerEvent::Ready { pid: 9, epoch: 100, moved: None };
    assert!(h.take(1, report(100, 0, &ready)).is_none());
    let exited = AgentMessage {
        job_id: "job-7".into(),
        epoch: 100,
        body: Some(agent_message::Body::Exited(proto::WorkerExited { slot: 1, status: "killed".into() })),
    };
    assert!(h.take(1, exited).is_none());
    assert_eq!(h.state().agents[&1].refused, 2);
    // The other agent's stand.
    assert!(h.take(0, report(100, 0, &ready)).is_some());
}

/// An agent's hello that claims its place in a running job (its controller was lost).
fn rejoin(job: &str, agent: u64, first_worker: u64, epochs: Vec<u64>) -> AgentHello {
    let nonce = auth::nonce().unwrap().to_vec();
    let claim = proto::Rejoin { job_id: job.into(), agent, first_worker, epochs, orphaned_ms: 1500 };
    let mut h = AgentHello { proof: Vec::new(), nonce, gpus: 2, host: "10.0.0.2".into(), pid: 1, rejoin: Some(claim) };
    h.proof = auth::prove(SECRET, &hello_context(&h), &CHALLENGE, &h.nonce).to_vec();
    h
}

#[test]
fn a_controller_that_took_a_job_back_readmits_its_members_once_and_no_one_else() {
    // A controller that did not take a job back refuses every claim.
    let (h, _rx) = hub(4, 2);
    let e = h.admit(&rejoin("job-7", 0, 0, vec![100, 100]), &CHALLENGE, link()).unwrap_err();
    assert!(e.code() == tonic::Code::FailedPrecondition && e.message().contains(&Setting::ResumeJob.to_string()), "{e:?}");
    // One that did: members 0..4 of job-7 (workers 4 and 5 were lost before), 3 agents so far.
    let (h, rx) = hub(4, 2);
    h.take_back(&[0, 1, 2, 3], 6, 3);
    let mut fleet = h.taken_back(rx, 6, joiner());
    let other = h.admit(&rejoin("job-8", 0, 0, vec![100, 100]), &CHALLENGE, link()).unwrap_err();
    assert!(other.message().contains("job-8"), "{other:?}");
    let lost = h.admit(&rejoin("job-7", 2, 4, vec![100, 100]), &CHALLENGE, link()).unwrap_err();
    assert!(lost.message().contains("not members"), "{lost:?}");
    let short = h.admit(&rejoin("job-7", 0, 0, vec![100]), &CHALLENGE, link()).unwrap_err();
    assert_eq!(short.code(), tonic::Code::InvalidArgument);
    // A claim altered on the way proves nothing.
    let mut forged = rejoin("job-7", 0, 0, vec![100, 100]);
    forged.rejoin.as_mut().unwrap().first_worker = 2;
    assert_eq!(h.admit(&forged, &CHALLENGE, link()).unwrap_err().code(), tonic::Code::PermissionDenied);
    assert_eq!(h.admit(&rejoin("job-7", 1, 2, vec![100, 99]), &CHALLENGE, link()).unwrap(), 1);
    let twice = h.admit(&rejoin("job-7", 1, 2, vec![100, 99]), &CHALLENGE, link()).unwrap_err();
    assert!(twice.message().contains("not members"), "claimed already: {twice:?}");
    // Its reports are its workers' (ids 2 and 3), stamped with the epochs it claimed.
    h.input(HubInput::Rejoined { agent: 1, first: 2 });
    let paused = WorkerEvent::Paused { epoch: 99, steps_done: 8, holds: vec![], snapshots: vec![] };
    let x = h.take(1, report(99, 1, &paused)).expect("a report of worker 3 at its epoch");
    h.input(x);
    assert!(matches!(fleet.next_event(Duration::from_millis(100)), Some(FleetEvent::Report { rank: 3, .. })));
    assert_eq!(fleet.without_a_controller(), Some(Duration::from_millis(1500)));
    // A newcomer is a joiner, numbered after every agent and worker of the job so far.
    assert_eq!(h.admit(&hello(SECRET, 2, "10.0.0.9"), &CHALLENGE, link()).unwrap(), 3);
}

/// A message to many workers is made once and sent once to each agent, naming its workers
/// among them, stamped with their epoch; an agent with none of them hears nothing.
#[test]
fn a_message_to_many_workers_goes_once_to_each_of_their_agents() {
    let (h, rx) = hub(6, 2);
    let mut agents = Vec::new();
    for host in ["10.0.0.2", "10.0.0.3", "10.0.0.4"] {
        let (tx, from_controller) = tokio::sync::mpsc::unbounded_channel();
        h.admit(&hello(SECRET, 2, host), &CHALLENGE, tx).unwrap();
        agents.push(from_controller);
    }
    let mut fleet = h.start(rx, job(), |rank, _| slot_to_proto(rank, 4, 0, 1.0, "", false), joiner()).unwrap();
    for a in &mut agents {
        let Ok(Ok(m)) = a.try_recv() else { panic!("the start") };
        let Some(controller_message::Body::Start(start)) = m.body else { panic!("{m:?}") };
        assert_eq!((start.job.clone(), start.standby), (job(), false), "the job once for the node's workers");
    }
    let pause = LauncherMessage::Pause { epoch: 102 };
    fleet.send_many(&[0, 1, 3], &pause).unwrap();
    let inputs = |a: &mut tokio::sync::mpsc::UnboundedReceiver<Result<ControllerMessage, Status>>| {
        std::iter::from_fn(|| a.try_recv().ok())
            .map(|m| {
                let m = m.unwrap();
                let Some(controller_message::Body::Input(i)) = m.body else { panic!("{m:?}") };
                let message = lazarus_protocol::relay::orders::decode(&i.message).unwrap();
                (m.epoch, i.slots, serde_json::to_string(&message).unwrap())
            })
            .collect::<Vec<_>>()
    };
    let line = serde_json::to_string(&pause).unwrap();
    assert_eq!(inputs(&mut agents[0]), vec![(102, vec![0, 1], line.clone())]);
    assert_eq!(inputs(&mut agents[1]), vec![(102, vec![1], line)]);
    assert_eq!(inputs(&mut agents[2]), vec![]);
    // A long message goes compressed, once for each agent (stamped with the epoch each worker is at).
    let long = LauncherMessage::Addrs { epoch: 100, addrs: vec!["10.0.0.1:7000".into(); lazarus_protocol::DEFLATE_LINES_OVER / 8] };
    fleet.send_many(&[0, 2], &long).unwrap();
    for a in agents.iter_mut().take(2) {
        let Ok(Ok(ControllerMessage { body: Some(controller_message::Body::Input(i)), .. })) = a.try_recv() else { panic!() };
        assert!(i.deflated && i.message.len() < 1000, "{} bytes", i.message.len());
        let message = lazarus_protocol::relay::orders::decode(&lazarus_protocol::inflate_bytes(&i.message).unwrap()).unwrap();
        assert_eq!(serde_json::to_string(&message).unwrap(), serde_json::to_string(&long).unwrap());
    }
    // Their reports of the epoch before are stale now; the others' are not.
    let ready = WorkerEvent::Ready { pid: 9, epoch: 100, moved: None };
    assert!(h.take(0, report(100, 1, &ready)).is_none());
    assert!(h.take(1, report(100, 0, &ready)).is_some());
}

/// Every worker is attached (both agents admitted) while the second agent's arrival is not yet
/// queued — an agent is counted a moment before its arrival is: the start still tells of it,
/// once, when it comes, instead of starting without a word of it.
#[test]
fn the_start_tells_of_an_arrival_queued_after_the_last_worker_is_counted() {
    let (h, rx) = hub(4, 2);
    let first = h.admit(&hello(SECRET, 2, "10.0.0.2"), &CHALLENGE, link()).unwrap();
    let second = h.admit(&hello(SECRET, 2, "10.0.0.3"), &CHALLENGE, link()).unwrap();
    h.input(HubInput::Joined { agent: first });
    // The second arrival is queued only once the start has told of the first.
    let (told_tx, told_rx) = std::sync::mpsc::channel::<()>();
    let late = {
        let h = h.clone();
        std::thread::spawn(move || {
            told_rx.recv().unwrap();
            h.input(HubInput::Joined { agent: second });
        })
    };
    let mut told = Vec::new();
    h.wait_for_agents(&rx, Instant::now() + Duration::from_secs(30), |info, attached, world| {
        told.push((info.agent, attached, world));
        let _ = told_tx.send(());
        Ok(())
    })
    .unwrap();
    late.join().unwrap();
    assert_eq!(told, vec![(first, 2, 4), (second, 4, 4)]);
}
