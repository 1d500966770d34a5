//! Collectives over real loopback TCP connections, one thread per rank.

use std::time::{Duration, Instant};

use lazarus_comm::{
    all_gather, all_reduce_sum_f32, all_to_all_v, barrier, broadcast, recv_named, send_named, CommError, Group, LocalTransport,
    TcpTransport, Transport, RING_THRESHOLD_BYTES,
};

const T: Duration = Duration::from_secs(10);

/// Run `f(rank, transport)` on every rank of a loopback group, in threads; results by rank.
fn on_group<R: Send + 'static>(n: usize, f: impl Fn(usize, &mut TcpTransport) -> R + Send + Sync + Clone + 'static) -> Vec<R> {
    let group = TcpTransport::local_group(n, 1).unwrap();
    let handles: Vec<_> = group
        .into_iter()
        .enumerate()
        .map(|(r, mut t)| {
            let f = f.clone();
            std::thread::spawn(move || f(r, &mut t))
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn all_gather_and_broadcast_and_barrier() {
    let out = on_group(4, |r, t| {
        let mut g = Group::world(4);
        let all = all_gather(t, &mut g, format!("rank{r}").as_bytes(), T).unwrap();
        let b = broadcast(t, &mut g, 2, if r == 2 { b"hello" } else { b"" }, T).unwrap();
        barrier(t, &mut g, T).unwrap();
        (all, b)
    });
    for (all, b) in out {
        assert_eq!(all, vec![b"rank0".to_vec(), b"rank1".to_vec(), b"rank2".to_vec(), b"rank3".to_vec()]);
        assert_eq!(b, b"hello");
    }
}

#[test]
fn all_to_all_v_with_uneven_and_empty_buffers() {
    let out = on_group(3, |r, t| {
        let mut g = Group::world(3);
        // Rank r sends r·10 + j bytes of value r to rank j; nothing to itself when r = j = 0.
        let sends: Vec<Vec<u8>> = (0..3).map(|j| vec![r as u8; r * 10 + j]).collect();
        all_to_all_v(t, &mut g, &sends, T).unwrap()
    });
    for (j, got) in out.iter().enumerate() {
        for (r, buf) in got.iter().enumerate() {
            assert_eq!(buf.len(), r * 10 + j, "from {r} to {j}");
            assert!(buf.iter().all(|&b| b == r as u8));
        }
    }
}

#[test]
fn all_reduce_small_and_ring_agree_and_are_identical_everywhere() {
    for len in [7usize, RING_THRESHOLD_BYTES / 4 * 3 + 5] {
        let out = on_group(4, move |r, t| {
            let mut g = Group::world(4);
            let mut buf: Vec<f32> = (0..len).map(|i| ((i * 7 + r * 13) % 101) as f32 * 0.01).collect();
            all_reduce_sum_f32(t, &mut g, &mut buf, T).unwrap();
            buf
        });
        for i in (0..len).step_by(997) {
            let want: f32 = (0..4).map(|r| ((i * 7 + r * 13) % 101) as f32 * 0.01).sum();
            assert!((out[0][i] - want).abs() < 1e-5, "len {len} i {i}: {} vs {want}", out[0][i]);
        }
        for o in &out[1..] {
            assert!(o.iter().zip(&out[0]).all(|(a, b)| a.to_bits() == b.to_bits()), "ranks disagree");
        }
    }
}

/// The exact all-reduce gives the bits of adding every term in one place, whatever the number
/// of ranks the terms are spread over (gathered whole when small, round a ring when large).
#[test]
fn the_exact_all_reduce_has_the_same_bits_whatever_the_ranks() {
    use lazarus_comm::exact::{all_reduce_exact, ExactSum};
    // 12 terms of `len` values each, spread over the ranks in contiguous runs.
    let term = |k: usize, i: usize| ((i * 7919 + k * 104_729) % 2003) as f32 * 1.37e-3 - 1.1;
    for len in [7usize, RING_THRESHOLD_BYTES / 16 * 2 + 3] {
        let mut alone = ExactSum::zeros(len);
        for k in 0..12 {
            alone.add_f32(0, &(0..len).map(|i| term(k, i)).collect::<Vec<_>>()).unwrap();
        }
        let want: Vec<u32> = alone.to_f32().iter().map(|v| v.to_bits()).collect();
        for ranks in 2..=4usize {
            let out = on_group(ranks, move |r, t| {
                let mut g = Group::world(ranks);
                let mut sum = ExactSum::zeros(len);
                for k in (0..12).filter(|k| k * ranks / 12 == r) {
                    sum.add_f32(0, &(0..len).map(|i| term(k, i)).collect::<Vec<_>>()).unwrap();
                }
                all_reduce_exact(t, &mut g, &mut sum, T).unwrap();
                sum.to_f32().iter().map(|v| v.to_bits()).collect::<Vec<u32>>()
            });
            for (r, got) in out.iter().enumerate() {
                assert!(got == &want, "len {len}, {ranks} ranks: rank {r} differs");
            }
        }
    }
}

#[test]
fn sub_groups_run_independently() {
    let out = on_group(4, |r, t| {
        // {0, 2} and {1, 3} each reduce their own values; then the world barrier.
        let mut g = Group::new(if r % 2 == 0 { vec![0, 2] } else { vec![1, 3] }).unwrap();
        let mut buf = vec![r as f32; 3];
        all_reduce_sum_f32(t, &mut g, &mut buf, T).unwrap();
        let mut w = Group::world(4);
        barrier(t, &mut w, T).unwrap();
        buf[0]
    });
    assert_eq!(out, vec![2.0, 4.0, 2.0, 4.0]);
}

#[test]
fn named_buffers_round_trip() {
    let out = on_group(2, |r, t| {
        if r == 0 {
            send_named(t, 1, 42, "blocks.0.moe.experts.3.fc1.w", &[1, 2, 3], T).unwrap();
            None
        } else {
            Some(recv_named(t, 0, 42, T).unwrap())
        }
    });
    assert_eq!(out[1], Some(("blocks.0.moe.experts.3.fc1.w".to_string(), vec![1, 2, 3])));
}

#[test]
fn timeouts_are_reported_not_hung() {
    // Rank 1 stays connected and silent until rank 0 has given up on it.
    let given_up = std::sync::Arc::new(std::sync::Barrier::new(2));
    let out = on_group(2, move |r, t| {
        if r == 0 {
            let start = Instant::now();
            let e = t.recv(1, 7, Instant::now() + Duration::from_millis(300)).unwrap_err();
            given_up.wait();
            (Some(e), start.elapsed())
        } else {
            given_up.wait();
            (None, Duration::ZERO)
        }
    });
    let (e, took) = &out[0];
    assert!(matches!(e, Some(CommError::Timeout { peer: 1, .. })), "{e:?}");
    assert!(*took < Duration::from_secs(2));
}

#[test]
fn a_dropped_peer_is_peer_lost_for_everyone() {
    let all_through = std::sync::Arc::new(std::sync::Barrier::new(3));
    // The survivors keep their connections until both have seen the loss: one that returned
    // and dropped its transport first would be a second peer lost for the other (a loaded
    // machine reported `PeerLost { peer: 0 }` to rank 2 that way).
    let both_saw_it = std::sync::Arc::new(std::sync::Barrier::new(2));
    let out = on_group(3, move |r, t| {
        let mut g = Group::world(3);
        barrier(t, &mut g, T).unwrap();
        // Every rank is through the barrier; then rank 1 vanishes as a crash would.
        all_through.wait();
        if r == 1 {
            t.abort_connections();
            return None;
        }
        let start = Instant::now();
        let mut buf = vec![1.0f32; 4];
        let e = all_reduce_sum_f32(t, &mut g, &mut buf, T).unwrap_err();
        let took = start.elapsed();
        both_saw_it.wait();
        Some((e, took))
    });
    for (r, o) in out.iter().enumerate() {
        if r == 1 {
            continue;
        }
        let (e, took) = o.as_ref().unwrap();
        assert!(matches!(e, CommError::PeerLost { peer: 1, .. }), "rank {r}: {e:?}");
        assert!(*took < Duration::from_secs(2), "rank {r} took {took:?}");
    }
}

#[test]
fn a_peer_that_leaves_cleanly_only_fails_those_waiting_for_it() {
    let left = std::sync::Arc::new(std::sync::Barrier::new(3));
    let out = on_group(3, move |r, t| {
        let mut g = Group::world(3);
        barrier(t, &mut g, T).unwrap();
        match r {
            0 => {
                t.shutdown();
                left.wait();
                None
            }
            // Once rank 0 has left, rank 1 and 2 keep talking to each other.
            _ => {
                let mut pair = Group::new(vec![1, 2]).unwrap();
                left.wait();
                let mut buf = vec![1.0f32; 2];
                all_reduce_sum_f32(t, &mut pair, &mut buf, T).unwrap();
                let e = t.recv(0, 1, Instant::now() + T).unwrap_err();
                Some((buf[0], e))
            }
        }
    });
    for o in out.into_iter().flatten() {
        assert_eq!(o.0, 2.0);
        assert!(matches!(o.1, CommError::PeerLost { peer: 0, .. }), "{:?}", o.1);
    }
}

/// A rank of an older epoch cannot join: its connection is dropped and the rendezvous reports it.
#[test]
fn stale_epochs_are_rejected_at_rendezvous() {
    let l0 = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let l1 = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addrs = vec![l0.local_addr().unwrap(), l1.local_addr().unwrap()];
    let a = addrs.clone();
    let stale = std::thread::spawn(move || TcpTransport::connect(l1, lazarus_comm::Rendezvous::new(1, a, 4, Duration::from_secs(5))));
    let r0 = TcpTransport::connect(l0, lazarus_comm::Rendezvous::new(0, addrs, 5, Duration::from_secs(1)));
    match r0 {
        Err(CommError::Rendezvous(msg)) => assert!(msg.contains("epoch 4") && msg.contains("current epoch 5"), "{msg}"),
        other => panic!("expected a rendezvous error, got {:?}", other.err()),
    }
    // The stale rank's connection was closed: its first receive fails instead of hanging.
    if let Ok(mut t) = stale.join().unwrap() {
        let e = t.recv(0, 1, Instant::now() + Duration::from_secs(5)).unwrap_err();
        assert!(matches!(e, CommError::PeerLost { .. }), "{e:?}");
    }
}

#[test]
fn bad_sends_are_invalid_not_fatal() {
    let out = on_group(2, |r, t| {
        if r == 0 {
            let e = t.send(1, u64::MAX, b"x", Instant::now() + T).unwrap_err();
            assert!(matches!(e, CommError::Invalid { field: "tag", .. }), "{e:?}");
            let e = t.send(5, 1, b"x", Instant::now() + T).unwrap_err();
            assert!(matches!(e, CommError::Invalid { field: "peer", .. }), "{e:?}");
        }
        // The transport still works after rejected arguments.
        let mut g = Group::world(2);
        barrier(t, &mut g, T).is_ok()
    });
    assert_eq!(out, vec![true, true]);
}

#[test]
fn one_rank_transport_runs_the_same_collectives() {
    let mut t = LocalTransport::new(3);
    let mut g = Group::world(1);
    let mut buf = vec![1.5f32, 2.5];
    all_reduce_sum_f32(&mut t, &mut g, &mut buf, T).unwrap();
    assert_eq!(buf, vec![1.5, 2.5]);
    let got = all_to_all_v(&mut t, &mut g, &[vec![9, 9]], T).unwrap();
    assert_eq!(got, vec![vec![9, 9]]);
    assert!(all_to_all_v(&mut t, &mut g, &[vec![], vec![]], T).is_err());
}

#[test]
fn a_deadline_beyond_what_a_clock_can_hold_is_no_panic() {
    // `--comm-timeout 1e19` once overflowed `Instant + Duration`.
    let mut t = LocalTransport::new(0);
    let mut g = Group::world(1);
    let mut buf = vec![1.0f32];
    all_reduce_sum_f32(&mut t, &mut g, &mut buf, std::time::Duration::MAX).unwrap();
    barrier(&mut t, &mut g, std::time::Duration::MAX).unwrap();
    let ts = TcpTransport::local_group(2, 0).unwrap();
    let handles: Vec<_> = ts
        .into_iter()
        .map(|mut t| {
            std::thread::spawn(move || {
                let mut g = Group::world(2);
                barrier(&mut t, &mut g, std::time::Duration::MAX).unwrap();
            })
        })
        .collect();
    handles.into_iter().for_each(|h| h.join().unwrap());
}

/// Two listeners on loopback and the rendezvous of epoch 3 between them: `with(rank, secret)`.
fn two_ranks(timeout: Duration) -> (std::net::TcpListener, std::net::TcpListener, impl Fn(usize, u128) -> lazarus_comm::Rendezvous) {
    let l0 = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let l1 = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addrs = vec![l0.local_addr().unwrap(), l1.local_addr().unwrap()];
    let with = move |rank, secret| {
        let mut r = lazarus_comm::Rendezvous::new(rank, addrs.clone(), 3, timeout);
        r.secret = secret;
        r
    };
    (l0, l1, with)
}

/// A process without the job's secret cannot take a rank: its hello is refused, the rendezvous
/// goes on and the real rank joins; without the real one it fails, naming the refused hello.
#[test]
fn a_hello_without_the_job_secret_is_refused() {
    let secret = 0x5eed_u128 << 64 | 42;
    let (l0, l1, with) = two_ranks(Duration::from_secs(3));
    let addrs = [l0.local_addr().unwrap()];
    // An intruder that knows the protocol, the rank and the epoch, but not the secret.
    let (impostor, real) = (with(1, 7), with(1, secret));
    let spare = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let intruder = std::thread::spawn(move || TcpTransport::connect(spare, impostor));
    let r0 = TcpTransport::connect(l0, with(0, secret));
    match r0 {
        Err(CommError::Rendezvous(msg)) => assert!(msg.contains("without the job's secret"), "{msg}"),
        other => panic!("the intruder must not be taken as rank 1: {:?}", other.map(|_| ())),
    }
    let _ = intruder.join();
    // With the real rank 1 the same rendezvous completes.
    let l0 = std::net::TcpListener::bind(addrs[0]).unwrap();
    let one = std::thread::spawn(move || TcpTransport::connect(l1, real));
    assert!(TcpTransport::connect(l0, with(0, secret)).is_ok());
    assert!(one.join().unwrap().is_ok());
}

/// A rank does not take a listener without the job's secret for a peer (another job's rank, or
/// something posing as one): the acceptor must prove the secret too.
#[test]
fn a_peer_that_cannot_prove_the_secret_is_not_connected_to() {
    let (l0, l1, with) = two_ranks(Duration::from_secs(2));
    let r0 = with(0, 7);
    let fake = std::thread::spawn(move || TcpTransport::connect(l0, r0));
    let got = TcpTransport::connect(l1, with(1, 99));
    assert!(
        matches!(&got, Err(CommError::Rendezvous(m)) if m.contains("did not prove it knows the job's secret")),
        "{:?}",
        got.map(|_| ())
    );
    assert!(fake.join().unwrap().is_err());
}

/// What crosses the wire in a rendezvous: nonces and proofs, never the secret itself (the
/// bytes both ways, read through a recording proxy).
#[test]
fn the_secret_never_crosses_the_wire() {
    use std::io::{Read, Write};
    use std::sync::{Arc, Mutex};
    let secret = 0x0123_4567_89ab_cdef_fedc_ba98_7654_3210u128;
    let l0 = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let l1 = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let proxy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let real0 = l0.local_addr().unwrap();
    // Rank 1 reaches rank 0 through the proxy.
    let addrs = vec![proxy.local_addr().unwrap(), l1.local_addr().unwrap()];
    let seen = Arc::new(Mutex::new(Vec::<u8>::new()));
    let seen_by_proxy = seen.clone();
    std::thread::spawn(move || {
        let (client, _) = proxy.accept().unwrap();
        let server = std::net::TcpStream::connect(real0).unwrap();
        let pipe = |mut from: std::net::TcpStream, mut to: std::net::TcpStream, seen: Arc<Mutex<Vec<u8>>>| {
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                while let Ok(n) = from.read(&mut buf) {
                    // Recorded before it is passed on: once a rank has a byte, the test sees it.
                    seen.lock().unwrap().extend_from_slice(&buf[..n]);
                    if n == 0 || to.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            })
        };
        pipe(client.try_clone().unwrap(), server.try_clone().unwrap(), seen_by_proxy.clone());
        pipe(server, client, seen_by_proxy);
    });
    let with = |rank| {
        let mut r = lazarus_comm::Rendezvous::new(rank, addrs.clone(), 1, Duration::from_secs(5));
        r.secret = secret;
        r
    };
    let r0 = with(0);
    let zero = std::thread::spawn(move || TcpTransport::connect(l0, r0).map(|_| ()));
    assert!(TcpTransport::connect(l1, with(1)).is_ok());
    assert!(zero.join().unwrap().is_ok());
    let bytes = seen.lock().unwrap().clone();
    assert!(bytes.len() >= 2 * 16 + 2 * 32, "the handshake went through the proxy: {} bytes", bytes.len());
    let key = secret.to_le_bytes();
    for w in [&key[..], &secret.to_be_bytes()[..], format!("{secret:032x}").as_bytes()] {
        assert!(!bytes.windows(8).any(|b| w.windows(8).any(|k| k == b)), "part of the secret crossed the wire");
    }
}

/// A rendezvous waiting for a rank that will never come is given up as soon as it is called
/// off, not at its deadline.
#[test]
fn a_cancelled_rendezvous_returns_at_once() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let dead = || {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    for rank in [0, 1] {
        // Rank 0 waits to accept a rank 1 that never comes; rank 1 tries to reach a rank 0
        // that is not there.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut addrs = vec![dead(), dead()];
        addrs[rank] = listener.local_addr().unwrap();
        let cancel = std::sync::Arc::new(AtomicBool::new(false));
        let mut r = lazarus_comm::Rendezvous::new(rank, addrs, 1, Duration::from_secs(60));
        r.cancel = Some(cancel.clone());
        let start = Instant::now();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            cancel.store(true, Ordering::Relaxed);
        });
        let got = TcpTransport::connect(listener, r);
        assert!(matches!(&got, Err(CommError::Rendezvous(m)) if m.contains("called off")), "rank {rank}: {:?}", got.map(|_| ()));
        assert!(start.elapsed() < Duration::from_secs(5), "rank {rank}: {:?}", start.elapsed());
    }
}

/// A snapshot frame sent before a collective is taken after it, and one that comes after
/// ordered frames is found behind them: out-of-band frames travel beside the ordered stream
/// (written by the sender's own thread), which stays in order and strict.
#[test]
fn snapshot_frames_travel_beside_the_ordered_stream() {
    use lazarus_comm::tags::{expert_transfer, TransferKind};
    let snap = expert_transfer(TransferKind::Snapshot, 1, 2).unwrap();
    let out = on_group(2, move |r, t| {
        let mut g = Group::world(2);
        let d = Instant::now() + T;
        if r == 0 {
            t.send_out_of_band(1, snap, b"expert state".to_vec(), d).unwrap();
        }
        let all = all_gather(t, &mut g, &[r as u8], T).unwrap();
        let got = if r == 1 { t.recv(0, snap, d).unwrap() } else { Vec::new() };
        barrier(t, &mut g, T).unwrap();
        (all, got)
    });
    assert_eq!(out[1], (vec![vec![0], vec![1]], b"expert state".to_vec()));
    // Ordered frames ahead of a snapshot stay queued, in order, for their own receives.
    let state = expert_transfer(TransferKind::StateTransfer, 1, 2).unwrap();
    let other = expert_transfer(TransferKind::StateTransfer, 1, 3).unwrap();
    let out = on_group(2, move |r, t| {
        let d = Instant::now() + T;
        if r == 0 {
            t.send(1, state, b"first", d).unwrap();
            t.send(1, other, b"second", d).unwrap();
            t.send(1, snap, b"snapshot", d).unwrap();
            None
        } else {
            let s = t.recv(0, snap, d).unwrap();
            Some((s, t.recv(0, state, d).unwrap(), t.recv(0, other, d).unwrap()))
        }
    });
    assert_eq!(out[1], Some((b"snapshot".to_vec(), b"first".to_vec(), b"second".to_vec())));
    // An ordered frame out of order is still a protocol error; a snapshot that never comes is
    // a timeout, not a reason to take an ordered frame for it.
    for ask_snapshot in [false, true] {
        // Rank 0 stays connected until rank 1 has its answer.
        let answered = std::sync::Arc::new(std::sync::Barrier::new(2));
        let out = on_group(2, move |r, t| {
            let got = if r == 0 {
                t.send(1, other, b"x", Instant::now() + T).unwrap();
                None
            } else if ask_snapshot {
                Some(t.recv(0, snap, Instant::now() + Duration::from_millis(300)))
            } else {
                Some(t.recv(0, state, Instant::now() + T))
            };
            answered.wait();
            got
        });
        let got = out[1].as_ref().unwrap();
        match ask_snapshot {
            true => assert!(matches!(got, Err(CommError::Timeout { .. })), "{got:?}"),
            false => assert!(matches!(got, Err(CommError::Protocol { .. })), "{got:?}"),
        }
    }
    // Only out-of-band tags may go out of band.
    let out = on_group(2, move |r, t| (r == 0).then(|| t.send_out_of_band(1, state, vec![1], Instant::now() + T)));
    assert!(matches!(out[0], Some(Err(CommError::Invalid { .. }))), "{:?}", out[0]);
}

/// A snapshot written by the transport's copy thread arrives as the encoder wrote it, many in a
/// row land intact (their buffers are used again: the frames must not bleed into each other),
/// and an encoder that fails or panics never leaves the receiver waiting: its connection is
/// closed, so the receive fails at once with the lost peer instead of at its deadline.
#[test]
fn encoded_snapshots_arrive_whole_and_a_failed_encoder_closes_the_connection() {
    use lazarus_comm::tags::{expert_transfer, TransferKind};
    let out = on_group(2, move |r, t| {
        let d = Instant::now() + T;
        let mut got = Vec::new();
        for round in 0..4u8 {
            let snap = expert_transfer(TransferKind::Snapshot, 0, round as usize).unwrap();
            if r == 0 {
                // Each round's frame is shorter than the last: a used-again buffer keeps
                // nothing of its previous frame.
                let len = (4 - round as usize) * 300_000;
                let encode: lazarus_comm::Encode = Box::new(move |out| {
                    out.extend((0..len).map(|i| (i as u8).wrapping_add(round)));
                    Ok(())
                });
                t.send_out_of_band_encoded(1, snap, len, encode, d).unwrap();
            } else {
                let b = t.recv(0, snap, d).unwrap();
                let want: Vec<u8> = (0..(4 - round as usize) * 300_000).map(|i| (i as u8).wrapping_add(round)).collect();
                got.push(b == want);
                t.recycle(b);
            }
        }
        // Frames still queued when a transport closes are dropped: stay until all arrived.
        barrier(t, &mut Group::world(2), T).unwrap();
        got
    });
    assert_eq!(out[1], vec![true; 4]);
    for panics in [false, true] {
        // Rank 0 stays up until rank 1 has its answer: the close it sees is the encoder's.
        let answered = std::sync::Arc::new(std::sync::Barrier::new(2));
        let out = on_group(2, move |r, t| {
            let snap = expert_transfer(TransferKind::Snapshot, 3, 4).unwrap();
            let start = Instant::now();
            let got = if r == 0 {
                let encode: lazarus_comm::Encode = Box::new(move |_| if panics { panic!("encoder bug") } else { Err("no weights".into()) });
                t.send_out_of_band_encoded(1, snap, 10, encode, Instant::now() + T).unwrap();
                None
            } else {
                Some(t.recv(0, snap, Instant::now() + Duration::from_secs(20)))
            };
            let took = start.elapsed();
            answered.wait();
            (got, took)
        });
        let (got, took) = &out[1];
        assert!(matches!(got, Some(Err(CommError::PeerLost { peer: 0, .. }))), "panics {panics}: {got:?}");
        assert!(*took < Duration::from_secs(10), "panics {panics}: failed after {took:?}, not at once");
    }
    // Only out-of-band tags may go out of band.
    let state = expert_transfer(TransferKind::StateTransfer, 1, 2).unwrap();
    let out = on_group(2, move |r, t| {
        (r == 0).then(|| {
            t.send_out_of_band_encoded(
                1,
                state,
                1,
                Box::new(|out| {
                    out.push(1);
                    Ok(())
                }),
                Instant::now() + T,
            )
        })
    });
    assert!(matches!(out[0], Some(Err(CommError::Invalid { .. }))), "{:?}", out[0]);
}

/// The backlog counts out-of-band frames not yet through the sender — one whose copy is still
/// running and the one queued behind it — and falls to none once they are written, or once a
/// frame is dropped (a failed encoder): what the snapshot tier's adaptive budget reads.
#[test]
fn the_out_of_band_backlog_counts_frames_until_they_are_on_the_wire() {
    use lazarus_comm::tags::{expert_transfer, TransferKind};
    // Rank 1 stays up until rank 0 has counted.
    let counted = std::sync::Arc::new(std::sync::Barrier::new(2));
    let out = on_group(2, move |r, t| {
        let d = Instant::now() + T;
        let (slow, quick, broken) = (
            expert_transfer(TransferKind::Snapshot, 0, 0).unwrap(),
            expert_transfer(TransferKind::Snapshot, 0, 1).unwrap(),
            expert_transfer(TransferKind::Snapshot, 0, 2).unwrap(),
        );
        let drained = |t: &TcpTransport| {
            let until = Instant::now() + T;
            while t.out_of_band_backlog() > 0 && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(1));
            }
            t.out_of_band_backlog()
        };
        if r == 0 {
            let idle = t.out_of_band_backlog();
            let encode: lazarus_comm::Encode = Box::new(|out| {
                std::thread::sleep(Duration::from_millis(400));
                out.push(7);
                Ok(())
            });
            t.send_out_of_band_encoded(1, slow, 1, encode, d).unwrap();
            t.send_out_of_band(1, quick, vec![8], d).unwrap();
            let held = t.out_of_band_backlog();
            let after = drained(t);
            barrier(t, &mut Group::world(2), T).unwrap();
            // A frame whose encoder fails is dropped: it leaves the backlog too.
            t.send_out_of_band_encoded(1, broken, 1, Box::new(|_| Err("no weights".into())), d).unwrap();
            let failed = drained(t);
            counted.wait();
            Some((idle, held, after, failed))
        } else {
            assert_eq!((t.recv(0, slow, d).unwrap(), t.recv(0, quick, d).unwrap()), (vec![7], vec![8]));
            barrier(t, &mut Group::world(2), T).unwrap();
            counted.wait();
            None
        }
    });
    assert_eq!(out[0], Some((0, 2, 0, 0)));
}

/// The CPU the transport's threads spend on out-of-band frames is counted on both ends — the
/// copy and write on the sender, the read on the receiver — and ordered frames count none.
#[test]
fn the_cpu_spent_on_out_of_band_frames_is_counted_on_both_ends() {
    use lazarus_comm::tags::{expert_transfer, TransferKind};
    let out = on_group(2, move |r, t| {
        let d = Instant::now() + T;
        let g = &mut Group::world(2);
        let state = expert_transfer(TransferKind::StateTransfer, 0, 0).unwrap();
        if r == 0 {
            t.send(1, state, &vec![1u8; 4 << 20], d).unwrap();
        } else {
            t.recv(0, state, d).unwrap();
        }
        barrier(t, g, T).unwrap();
        let ordered_only = t.out_of_band_cpu();
        for e in 0..4 {
            let snap = expert_transfer(TransferKind::Snapshot, 0, e).unwrap();
            if r == 0 {
                t.send_out_of_band_encoded(
                    1,
                    snap,
                    4 << 20,
                    Box::new(|out| {
                        out.resize(4 << 20, 3);
                        Ok(())
                    }),
                    d,
                )
                .unwrap();
            } else {
                assert_eq!(t.recv(0, snap, d).unwrap().len(), 4 << 20);
            }
        }
        // The sender's last write may end after the receiver has its bytes: wait for it.
        barrier(t, g, T).unwrap();
        while t.out_of_band_backlog() > 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
        (ordered_only, t.out_of_band_cpu())
    });
    for (rank, (ordered_only, after)) in out.iter().enumerate() {
        assert_eq!(*ordered_only, Duration::ZERO, "rank {rank}");
        assert!(*after > Duration::ZERO, "rank {rank}");
    }
}
