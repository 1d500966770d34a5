//! What a peer sends is validated: after a correct hello, any bytes at all — garbage, a header
//! with a bad magic, an oversized or lying length, a frame cut short — give the receiving rank a
//! typed error (or, if they happen to form a valid frame, that frame), never a panic, a hang or
//! an allocation the bytes do not pay for.

use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use lazarus_comm::{Rendezvous, TcpTransport, Transport};
use proptest::prelude::*;

const EPOCH: u64 = 5;

fn header(magic: u32, epoch: u64, tag: u64, len: u64) -> Vec<u8> {
    let mut b = Vec::with_capacity(28);
    b.extend_from_slice(&magic.to_le_bytes());
    b.extend_from_slice(&epoch.to_le_bytes());
    b.extend_from_slice(&tag.to_le_bytes());
    b.extend_from_slice(&len.to_le_bytes());
    b
}

/// This test as rank 1 of a job without a secret (0): its hello and the handshake with rank 0
/// at `addr` — what a real rank 1 sends before any frame.
fn say_hello(addr: std::net::SocketAddr) -> TcpStream {
    use lazarus_comm::auth;
    use std::io::Read;
    let mut s = TcpStream::connect(addr).unwrap();
    let ours = auth::nonce().unwrap();
    s.write_all(&[header(0x4c5a_4831, EPOCH, 1, auth::NONCE as u64), ours.to_vec()].concat()).unwrap();
    let mut answer = [0u8; auth::NONCE + auth::PROOF];
    s.read_exact(&mut answer).unwrap();
    let theirs = &answer[..auth::NONCE];
    s.write_all(&auth::prove(0, &auth::rendezvous_context("connect", 1, 0, EPOCH), theirs, &ours)).unwrap();
    s
}

/// Rank 0 of a world of 2, with this test as rank 1: rank 1 says hello, then sends `bytes` and
/// closes. Returns what rank 0's receive from rank 1 gave, and how long it took.
fn feed(bytes: &[u8]) -> (Result<Vec<u8>, lazarus_comm::CommError>, Duration) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let rank0 = std::thread::spawn(move || {
        let mut t = TcpTransport::connect(listener, Rendezvous::new(0, vec![addr, addr], EPOCH, Duration::from_secs(10))).unwrap();
        let start = Instant::now();
        let got = t.recv(1, 7, Instant::now() + Duration::from_secs(5));
        (got, start.elapsed())
    });
    let mut s = say_hello(addr);
    let _ = s.write_all(bytes);
    let _ = s.shutdown(std::net::Shutdown::Both);
    rank0.join().expect("rank 0 must not panic")
}

#[test]
fn known_bad_frames_are_typed_errors() {
    let magic = 0x4c5a_5231;
    for (what, bytes) in [
        ("bad magic", header(0xdead_beef, EPOCH, 7, 0)),
        ("length beyond the 1 GiB frame limit", header(magic, EPOCH, 7, (1 << 30) + 1)),
        ("a 1 GiB frame with 3 bytes of it", [header(magic, EPOCH, 7, 1 << 30), vec![1, 2, 3]].concat()),
        ("an older epoch", header(magic, EPOCH - 1, 7, 0)),
        ("a newer epoch", header(magic, EPOCH + 1, 7, 0)),
        ("another tag", header(magic, EPOCH, 8, 0)),
        ("half a header", header(magic, EPOCH, 7, 0)[..13].to_vec()),
    ] {
        let (got, took) = feed(&bytes);
        assert!(got.is_err(), "{what}: {got:?}");
        assert!(took < Duration::from_secs(5), "{what}: took {took:?}");
    }
    let (got, _) = feed(&[header(magic, EPOCH, 7, 3), vec![1, 2, 3]].concat());
    assert_eq!(got.unwrap(), vec![1, 2, 3], "a valid frame still arrives");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    #[test]
    fn any_bytes_after_the_hello_are_an_error_or_a_frame(
        bytes in proptest::collection::vec(any::<u8>(), 0..200),
        len in any::<u64>(),
        framed in any::<bool>(),
    ) {
        let input = if framed { [header(0x4c5a_5231, EPOCH, 7, len), bytes].concat() } else { bytes };
        let (_, took) = feed(&input);
        prop_assert!(took < Duration::from_secs(5), "took {:?}", took);
    }
}

/// A snapshot is written by the transport's own thread: sending one to a peer that reads
/// nothing (a stalled process) does not hold the caller, as a plain send of the same bytes does
/// until its deadline. When the frame cannot be delivered by its deadline the connection is
/// closed, so the next exchange with that peer fails at once instead of reading a frame cut short.
#[test]
fn a_snapshot_to_a_peer_that_reads_nothing_does_not_hold_the_sender() {
    let snap = lazarus_comm::tags::expert_transfer(lazarus_comm::tags::TransferKind::Snapshot, 0, 1).unwrap();
    let big = vec![7u8; 64 << 20]; // far more than the socket buffers hold
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let rank0 = std::thread::spawn(move || {
        let mut t = TcpTransport::connect(listener, Rendezvous::new(0, vec![addr, addr], EPOCH, Duration::from_secs(10))).unwrap();
        let start = Instant::now();
        t.send_out_of_band(1, snap, big.clone(), Instant::now() + Duration::from_millis(1500)).unwrap();
        let queued_in = start.elapsed();
        // The ordered stream to that peer is cut once the snapshot's deadline passes.
        let next = t.recv(1, 7, Instant::now() + Duration::from_secs(10));
        (queued_in, next, start.elapsed())
    });
    // Rank 1: a hello, then nothing is ever read.
    let s = say_hello(addr);
    let (queued_in, next, until_cut) = rank0.join().unwrap();
    assert!(queued_in < Duration::from_millis(500), "the caller went on after {queued_in:?}");
    assert!(matches!(next, Err(lazarus_comm::CommError::PeerLost { peer: 1, .. })), "{next:?}");
    assert!(until_cut < Duration::from_secs(8), "cut after {until_cut:?}, not at the receive's own deadline");
    drop(s);

    // The same bytes through a plain send hold the caller until its deadline.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let rank0 = std::thread::spawn(move || {
        let mut t = TcpTransport::connect(listener, Rendezvous::new(0, vec![addr, addr], EPOCH, Duration::from_secs(10))).unwrap();
        let start = Instant::now();
        let got = t.send(1, snap, &vec![7u8; 64 << 20], Instant::now() + Duration::from_millis(1500));
        (got, start.elapsed())
    });
    let s = say_hello(addr);
    let (got, took) = rank0.join().unwrap();
    assert!(matches!(got, Err(lazarus_comm::CommError::Timeout { .. })), "{got:?}");
    assert!(took >= Duration::from_millis(1000), "a plain send returned after {took:?}");
    drop(s);
}
