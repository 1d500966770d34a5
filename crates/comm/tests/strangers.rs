//! Strangers at a rank's port, on real loopback sockets: connections that stay silent, that
//! trickle a byte at a time, that send garbage, or that keep coming in a flood, made before and
//! while the ranks meet. The ranks must connect as if nobody else were there — without waiting
//! for the strangers to be dropped — and a stranger is dropped at the handshake deadline (2 s),
//! however it trickles.
//!
//! No wall-clock bound is asserted: a rank that handled strangers one at a time (each given 2 s
//! to say hello) would run past the rendezvous's own 10-s deadline behind 20 silent ones and
//! fail, and a trickler whose every byte restarted a read timeout would finish its 76-byte
//! handshake before it was dropped.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lazarus_comm::{all_reduce_sum_f32, Group, Rendezvous, TcpTransport};

const SECRET: u128 = 0x5eed_0000_1111_2222_3333_4444_5555_6666;

/// Whether the other end has closed `s` (a read sees EOF or a reset), without waiting.
fn closed(s: &mut TcpStream) -> bool {
    s.set_nonblocking(true).unwrap();
    let mut b = [0u8; 64];
    loop {
        match s.read(&mut b) {
            Ok(0) => return true,
            Ok(_) => continue, // an answer to a garbage hello would be a bug, but not this check's
            Err(e) if e.kind() == ErrorKind::WouldBlock => return false,
            Err(_) => return true,
        }
    }
}

/// `world` listeners on loopback and their addresses.
fn listeners(world: usize) -> (Vec<TcpListener>, Vec<SocketAddr>) {
    let l: Vec<TcpListener> = (0..world).map(|_| TcpListener::bind("127.0.0.1:0").unwrap()).collect();
    let a = l.iter().map(|l| l.local_addr().unwrap()).collect();
    (l, a)
}

/// How long the ranks of these tests have to meet.
const MEET_WITHIN: Duration = Duration::from_secs(10);

/// The bytes of a hello that looks like rank `rank`'s at epoch 3 (header, then a nonce), and a
/// proof after it: 76 bytes that only a rank with the secret could end well.
fn lookalike(rank: u64) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(&0x4c5a_4831u32.to_le_bytes()); // "LZH1"
    b.extend_from_slice(&3u64.to_le_bytes());
    b.extend_from_slice(&rank.to_le_bytes());
    b.extend_from_slice(&16u64.to_le_bytes());
    b.extend_from_slice(&[7u8; 16 + 32]);
    b
}

/// Send `bytes` to `at` one every 100 ms; how many were sent when the other end dropped the
/// connection (None: it took them all and it did not).
fn trickle(at: SocketAddr, bytes: &[u8], stop: &AtomicBool) -> Option<usize> {
    let mut s = TcpStream::connect(at).unwrap();
    for (i, b) in bytes.iter().enumerate() {
        if stop.load(Ordering::Relaxed) {
            return None;
        }
        if s.write_all(&[*b]).is_err() || closed(&mut s) {
            return Some(i);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    // Sent it all: give the other end its answer's time to drop it.
    std::thread::sleep(Duration::from_millis(500));
    closed(&mut s).then_some(bytes.len())
}

/// Every rank's rendezvous, in threads; then an all-reduce over the group, which proves the
/// connections carry frames.
fn meet(listeners: Vec<TcpListener>, addrs: Vec<SocketAddr>) -> Vec<f32> {
    let world = addrs.len();
    let ranks: Vec<_> = listeners
        .into_iter()
        .enumerate()
        .map(|(rank, l)| {
            let addrs = addrs.clone();
            std::thread::spawn(move || {
                let r = Rendezvous { secret: SECRET, ..Rendezvous::new(rank, addrs, 3, MEET_WITHIN) };
                let mut t = TcpTransport::connect(l, r).unwrap_or_else(|e| panic!("rank {rank}: {e}"));
                let mut x = vec![rank as f32 + 1.0];
                all_reduce_sum_f32(&mut t, &mut Group::world(world), &mut x, Duration::from_secs(30)).unwrap();
                x[0]
            })
        })
        .collect();
    ranks.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn silent_trickling_and_garbage_connections_neither_delay_nor_fail_the_ranks() {
    let world = 4;
    let (l, addrs) = listeners(world);
    // Before any rank meets: at every port that accepts (ranks 0..3), twenty silent
    // connections, one of garbage, and one that trickles a hello that looks like a rank's.
    let mut strangers: Vec<TcpStream> = Vec::new();
    let stop = Arc::new(AtomicBool::new(false));
    let mut tricklers = Vec::new();
    for (rank, at) in addrs[..world - 1].iter().enumerate() {
        for _ in 0..20 {
            strangers.push(TcpStream::connect(at).unwrap());
        }
        let mut garbage = TcpStream::connect(at).unwrap();
        garbage.write_all(&[0xAB; 200]).unwrap();
        strangers.push(garbage);
        let (at, stop) = (*at, stop.clone());
        tricklers.push(std::thread::spawn(move || trickle(at, &lookalike(rank as u64 + 1), &stop)));
    }
    let begun = Instant::now();
    let sums = meet(l, addrs);
    eprintln!("the ranks met in {:?} beside {} strangers", begun.elapsed(), strangers.len() + tricklers.len());
    assert_eq!(sums, vec![10.0; world], "every rank connected and the connections carry frames");
    stop.store(true, Ordering::Relaxed);
    for t in tricklers {
        let _ = t.join().unwrap();
    }
}

#[test]
fn a_rank_that_is_still_waiting_drops_a_trickler_at_its_deadline() {
    // Rank 0 waits for rank 1, which comes only once the trickler is dropped.
    let (mut l, addrs) = listeners(2);
    let l0 = l.remove(0);
    let waiting = std::thread::spawn({
        let addrs = addrs.clone();
        move || {
            let r = Rendezvous { secret: SECRET, ..Rendezvous::new(0, addrs, 3, Duration::from_secs(60)) };
            TcpTransport::connect(l0, r).map(|_| ())
        }
    });
    let bytes = lookalike(1);
    let sent = trickle(addrs[0], &bytes, &AtomicBool::new(false));
    let sent = sent.expect("the trickler was never dropped");
    assert!(sent < bytes.len(), "dropped while it still trickled its handshake, not after it: {sent} of {} bytes", bytes.len());
    // And the rank it trickled at goes on to meet rank 1.
    let r1 = Rendezvous { secret: SECRET, ..Rendezvous::new(1, addrs, 3, MEET_WITHIN) };
    assert!(TcpTransport::connect(l.remove(0), r1).is_ok());
    waiting.join().unwrap().unwrap();
}

#[test]
fn a_flood_of_connections_does_not_keep_the_ranks_apart() {
    // A stranger opens connections to rank 0's port as fast as it can, more than the accepting
    // side keeps under way, for as long as the ranks meet.
    let (l, addrs) = listeners(3);
    let stop = Arc::new(AtomicBool::new(false));
    let opened = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let flood = {
        let (at, stop, opened) = (addrs[0], stop.clone(), opened.clone());
        std::thread::spawn(move || {
            let mut held = std::collections::VecDeque::new();
            while !stop.load(Ordering::Relaxed) {
                if let Ok(s) = TcpStream::connect(at) {
                    opened.fetch_add(1, Ordering::Relaxed);
                    held.push_back(s);
                    if held.len() > 500 {
                        held.pop_front();
                    }
                }
            }
        })
    };
    // The flood is under way, beyond what the rank keeps under way (64), before the ranks meet
    // (and within the listener's backlog of 128: nobody accepts yet).
    let until = Instant::now() + Duration::from_secs(30);
    while opened.load(Ordering::Relaxed) < 100 {
        assert!(Instant::now() < until, "the flood never got going: {} connections", opened.load(Ordering::Relaxed));
        std::thread::sleep(Duration::from_millis(1));
    }
    let sums = meet(l, addrs);
    stop.store(true, Ordering::Relaxed);
    flood.join().unwrap();
    let opened = opened.load(Ordering::Relaxed);
    assert_eq!(sums, vec![6.0; 3]);
    eprintln!("the flood opened {opened} connections while the ranks met");
}
