//! What sealing the data plane costs (`--encrypt-data`): two ranks over loopback TCP, one
//! sending frames the other receives, in clear and sealed; and what a rendezvous of two ranks
//! takes, in clear and sealed (the sealed one adds a TLS 1.3 handshake per connection).
//!
//! `cargo bench -p lazarus-comm --bench sealed`

use std::net::TcpListener;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use lazarus_comm::{Rendezvous, TcpTransport, Transport};

const SECRET: u128 = 0x5eed_5eed_5eed_5eed_5eed_5eed_5eed_5eed;

/// Two connected ranks on loopback.
fn pair(encrypt: bool) -> (TcpTransport, TcpTransport) {
    let (l0, l1) = (TcpListener::bind("127.0.0.1:0").unwrap(), TcpListener::bind("127.0.0.1:0").unwrap());
    let addrs = vec![l0.local_addr().unwrap(), l1.local_addr().unwrap()];
    let with = |rank: usize| {
        let mut r = Rendezvous::new(rank, addrs.clone(), 1, Duration::from_secs(10));
        r.secret = SECRET;
        r.encrypt = encrypt;
        r
    };
    let r0 = with(0);
    let zero = std::thread::spawn(move || TcpTransport::connect(l0, r0).unwrap());
    let one = TcpTransport::connect(l1, with(1)).unwrap();
    (zero.join().unwrap(), one)
}

fn frames(c: &mut Criterion) {
    for size in [64 << 10, 16 << 20] {
        let mut g = c.benchmark_group(format!("frame_{}k", size >> 10));
        g.throughput(Throughput::Bytes(size as u64));
        g.sample_size(20);
        for encrypt in [false, true] {
            let (mut zero, mut one) = pair(encrypt);
            let payload = vec![7u8; size];
            g.bench_function(if encrypt { "sealed" } else { "clear" }, |b| {
                b.iter(|| {
                    let deadline = Instant::now() + Duration::from_secs(30);
                    std::thread::scope(|s| {
                        s.spawn(|| one.send(0, 7, &payload, deadline).unwrap());
                        zero.recv(1, 7, deadline).unwrap()
                    })
                })
            });
        }
        g.finish();
    }
}

fn rendezvous(c: &mut Criterion) {
    let mut g = c.benchmark_group("rendezvous_2_ranks");
    g.sample_size(20);
    for encrypt in [false, true] {
        g.bench_function(if encrypt { "sealed" } else { "clear" }, |b| b.iter(|| pair(encrypt)));
    }
    g.finish();
}

criterion_group!(benches, frames, rendezvous);
criterion_main!(benches);
