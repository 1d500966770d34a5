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
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(&[header(0x4c5a_4831, EPOCH, 1, 16), vec![0; 16]].concat()).unwrap();
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
