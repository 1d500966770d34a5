//! The encrypted data plane (`Rendezvous::encrypt`), over real loopback TCP through a proxy that
//! records — or alters — what crosses: the collectives give the same results sealed as in
//! clear; sealed, the payloads never appear on the wire (in clear they do: the test can tell);
//! a byte altered on the way closes the connection instead of delivering the frame; and a rank
//! that seals meets a rank that does not with a rendezvous error naming the flag.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lazarus_comm::{all_reduce_sum_f32, CommError, Group, Rendezvous, TcpTransport, Transport};

const SECRET: u128 = 0x0123_4567_89ab_cdef_fedc_ba98_7654_3210;

/// A proxy to `to` that records every byte both ways; once `flip` is set, it alters a byte of
/// the next bytes rank 1 sends (the 61st, or the last of a shorter read).
fn proxy(to: SocketAddr, flip: Option<Arc<AtomicBool>>) -> (SocketAddr, Arc<Mutex<Vec<u8>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let all = seen.clone();
    std::thread::spawn(move || {
        let (client, _) = listener.accept().unwrap();
        let server = TcpStream::connect(to).unwrap();
        let flipped = Arc::new(AtomicBool::new(false));
        for (from, into, alter) in [(client.try_clone().unwrap(), server.try_clone().unwrap(), flip), (server, client, None)] {
            let (seen, flipped) = (all.clone(), flipped.clone());
            std::thread::spawn(move || {
                let (mut from, mut into) = (from, into);
                let mut buf = [0u8; 8192];
                while let Ok(n) = from.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    if alter.as_ref().is_some_and(|armed| armed.load(Ordering::SeqCst)) && !flipped.swap(true, Ordering::Relaxed) {
                        buf[60.min(n - 1)] ^= 0x40;
                    }
                    seen.lock().unwrap().extend_from_slice(&buf[..n]);
                    if into.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
                let _ = into.shutdown(std::net::Shutdown::Write);
            });
        }
    });
    (addr, seen)
}

/// Two connected ranks, or why they are not.
type Pair = Result<(TcpTransport, TcpTransport), CommError>;

/// Two ranks, rank 1 reaching rank 0 through a proxy; each rank's `encrypt`.
fn pair(encrypt: [bool; 2], flip: Option<Arc<AtomicBool>>) -> (Pair, Arc<Mutex<Vec<u8>>>) {
    let (l0, l1) = (TcpListener::bind("127.0.0.1:0").unwrap(), TcpListener::bind("127.0.0.1:0").unwrap());
    let (via, seen) = proxy(l0.local_addr().unwrap(), flip);
    let addrs = vec![via, l1.local_addr().unwrap()];
    let with = |rank: usize| {
        let mut r = Rendezvous::new(rank, addrs.clone(), 1, Duration::from_secs(3));
        r.secret = SECRET;
        r.encrypt = encrypt[rank];
        r
    };
    let r0 = with(0);
    let zero = std::thread::spawn(move || TcpTransport::connect(l0, r0));
    let one = TcpTransport::connect(l1, with(1));
    let zero = zero.join().unwrap();
    (zero.and_then(|z| one.map(|o| (z, o))), seen)
}

/// A recognisable payload: 4,096 floats, each 1000 + its index.
fn payload() -> Vec<f32> {
    (0..4096).map(|i| 1000.0 + i as f32).collect()
}

/// Sum `payload()` over the pair (rank 1 adds it, rank 0 adds zeroes): what each rank got.
fn all_reduce(pair: (TcpTransport, TcpTransport)) -> Vec<Vec<f32>> {
    let (mut zero, mut one) = pair;
    let t = Duration::from_secs(5);
    let other = std::thread::spawn(move || {
        let mut x = payload();
        all_reduce_sum_f32(&mut one, &mut Group::world(2), &mut x, t).unwrap();
        x
    });
    let mut x = vec![0.0f32; 4096];
    all_reduce_sum_f32(&mut zero, &mut Group::world(2), &mut x, t).unwrap();
    vec![x, other.join().unwrap()]
}

fn contains_payload(bytes: &[u8]) -> bool {
    let p: Vec<u8> = payload()[100..108].iter().flat_map(|f| f.to_le_bytes()).collect();
    bytes.windows(p.len()).any(|w| w == p)
}

#[test]
fn sealed_frames_carry_the_same_results_and_nothing_readable() {
    for encrypt in [false, true] {
        let (pair, seen) = pair([encrypt, encrypt], None);
        let got = all_reduce(pair.unwrap());
        assert_eq!(got, vec![payload(), payload()], "encrypt {encrypt}: the sum everywhere");
        // (The proxy records what it passes on before it passes it on.)
        let bytes = seen.lock().unwrap().clone();
        assert!(bytes.len() > 4096 * 4, "the frames went through the proxy");
        assert_eq!(contains_payload(&bytes), !encrypt, "encrypt {encrypt}: the payload on the wire");
    }
}

#[test]
fn a_byte_altered_on_the_way_closes_the_connection_instead_of_delivering() {
    // Armed once the ranks are connected (past the hello, the proofs and the TLS handshake):
    // a byte inside the first sealed frame.
    let armed = Arc::new(AtomicBool::new(false));
    let (pair, _) = pair([true, true], Some(armed.clone()));
    let (mut zero, mut one) = pair.unwrap();
    armed.store(true, Ordering::SeqCst);
    let deadline = Instant::now() + Duration::from_secs(5);
    one.send(0, 7, &[42u8; 1000], deadline).unwrap();
    match zero.recv(1, 7, deadline) {
        Err(CommError::PeerLost { reason, .. }) => assert!(reason.contains("does not open"), "{reason}"),
        other => panic!("an altered frame must not be delivered: {other:?}"),
    }
}

#[test]
fn a_rank_that_seals_meets_one_that_does_not_with_an_error_naming_the_flag() {
    let (got, _) = pair([false, true], None);
    match got {
        Err(CommError::Rendezvous(msg)) => {
            assert!(msg.contains(&lazarus_setting::Setting::EncryptData.to_string()) || msg.contains("seal"), "{msg}")
        }
        other => panic!("mismatched ranks must not connect: {:?}", other.map(|_| ())),
    }
}
