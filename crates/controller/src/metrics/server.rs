//! The HTTP endpoint Prometheus scrapes (`--metrics-listen ADDR`, `GET /metrics`), on hyper.
//!
//! Anyone who can reach the port can open connections to it, so it is built not to stall:
//! every connection is served on its own task (a silent one never delays a scrape), must send
//! its request head within [`HEAD_WITHIN`] and is done within [`CONNECTION_WITHIN`], and at
//! most [`MOST_CONNECTIONS`] are open — a new one beyond that closes the oldest (a scrape takes
//! milliseconds, so the oldest is a stranger's). Before, one connection was read at a time: ten
//! silent ones delayed a scrape by ten seconds, three hundred stopped it.
//!
//! With a token (`--metrics-token-file`), a scrape must carry `Authorization: Bearer TOKEN`
//! (Prometheus: `authorization: {credentials_file: …}`); without one it gets 401.

use lazarus_setting::Setting;
use std::collections::VecDeque;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt as _, Full};
use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};

use super::JobMetrics;
use crate::dashboard::{Dashboard, DASHBOARD_PATH};
use crate::service::SharedStatus;
use lazarus_protocol::ControlError;

/// How long a connection has to send its request's head.
pub const HEAD_WITHIN: Duration = Duration::from_secs(2);
/// How long a connection may last in all.
pub const CONNECTION_WITHIN: Duration = Duration::from_secs(10);
/// The most connections open at once.
pub const MOST_CONNECTIONS: usize = 256;
/// The most bytes of a request's head read (a scrape's is a few hundred).
const MAX_HEAD: usize = 8 << 10;

/// Where the metrics are served, and to whom.
#[derive(Debug, Clone)]
pub struct MetricsEndpoint {
    pub listen: SocketAddr,
    /// A scrape must carry `Authorization: Bearer` this (None: anyone may scrape).
    pub token: Option<String>,
}

/// The HTTP endpoint Prometheus scrapes; stops when dropped.
pub struct MetricsServer {
    server: crate::server_thread::ServerThread,
}

impl MetricsServer {
    /// Serve `metrics` (and `status`'s members and epoch) at `at.listen`, `GET /metrics`.
    pub fn start(at: &MetricsEndpoint, metrics: Arc<JobMetrics>, status: Option<SharedStatus>) -> Result<Self, ControlError> {
        let page = Page { metrics: Some(Metrics { metrics, status, token: at.token.clone() }), dashboard: None };
        Self::serve_at(at.listen, Setting::MetricsListen, page)
    }

    /// Serve `dashboard` at `listen`, `GET /dashboard?token=…` (and its stream).
    pub fn start_dashboard(listen: SocketAddr, dashboard: Arc<Dashboard>) -> Result<Self, ControlError> {
        Self::serve_at(listen, Setting::DashboardListen, Page { metrics: None, dashboard: Some(dashboard) })
    }

    fn serve_at(listen: SocketAddr, flag: Setting, page: Page) -> Result<Self, ControlError> {
        let listener = std::net::TcpListener::bind(listen).map_err(|e| ControlError::io(format!("{flag}: binding {listen}"), e))?;
        let addr = listener.local_addr().map_err(|e| ControlError::io("reading the HTTP server's address", e))?;
        listener.set_nonblocking(true).map_err(|e| ControlError::io("the HTTP listener", e))?;
        let runtime = lazarus_protocol::rpc::runtime(1, "lazarus-http")?;
        let (stop, mut stopped) = tokio::sync::watch::channel(false);
        let page = Arc::new(page);
        let thread = std::thread::Builder::new()
            .name("lazarus-http".into())
            .spawn(move || {
                runtime.block_on(async move {
                    let listener = match tokio::net::TcpListener::from_std(listener) {
                        Ok(l) => l,
                        Err(e) => return tracing::warn!("HTTP server: {e}"),
                    };
                    let mut open: VecDeque<tokio::task::JoinHandle<()>> = VecDeque::new();
                    loop {
                        let stream = tokio::select! {
                            accepted = listener.accept() => match accepted {
                                Ok((stream, _)) => stream,
                                Err(e) => {
                                    tracing::debug!("HTTP server: accept: {e}");
                                    tokio::time::sleep(Duration::from_millis(50)).await;
                                    continue;
                                }
                            },
                            _ = stopped.wait_for(|&s| s) => return,
                        };
                        open.retain(|t| !t.is_finished());
                        if open.len() >= MOST_CONNECTIONS {
                            if let Some(oldest) = open.pop_front() {
                                oldest.abort();
                            }
                        }
                        open.push_back(tokio::spawn(serve(stream, page.clone())));
                    }
                });
            })
            .map_err(|e| ControlError::io("starting the HTTP server", e))?;
        Ok(MetricsServer { server: crate::server_thread::ServerThread::new(addr, stop, thread) })
    }

    pub fn addr(&self) -> SocketAddr {
        self.server.addr()
    }
}

/// What a server answers: the metrics a scrape reads, or the dashboard.
struct Page {
    metrics: Option<Metrics>,
    dashboard: Option<Arc<Dashboard>>,
}

/// What a scrape reads, and who may.
struct Metrics {
    metrics: Arc<JobMetrics>,
    status: Option<SharedStatus>,
    token: Option<String>,
}

type Body = BoxBody<Bytes, Infallible>;

/// One connection: HTTP/1.1, its head within [`HEAD_WITHIN`], all of it within
/// [`CONNECTION_WITHIN`].
async fn serve(stream: tokio::net::TcpStream, page: Arc<Page>) {
    let _ = stream.set_nodelay(true);
    let service = hyper::service::service_fn(move |req| {
        let page = page.clone();
        async move { Ok::<_, Infallible>(answer(&req, &page)) }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(HEAD_WITHIN)
        .max_buf_size(MAX_HEAD)
        .keep_alive(false)
        .serve_connection(TokioIo::new(stream), service);
    let _ = tokio::time::timeout(CONNECTION_WITHIN, conn).await;
}

fn reply(code: StatusCode, kind: &str, body: impl Into<Bytes>) -> Response<Body> {
    let mut r = Response::new(Full::new(body.into()).boxed());
    *r.status_mut() = code;
    if let Ok(v) = kind.parse() {
        r.headers_mut().insert(hyper::header::CONTENT_TYPE, v);
    }
    r
}

/// `GET /metrics` gets the text format (with the token, where one is set); `GET /dashboard`,
/// its state and its stream go to holders of the status token; anything else a 404.
fn answer(req: &Request<Incoming>, page: &Page) -> Response<Body> {
    let path = req.uri().path();
    let what = match (&page.metrics, &page.dashboard) {
        (Some(_), _) => "lazarus: metrics are at GET /metrics\n",
        (None, _) => "lazarus: the dashboard is at GET /dashboard?token=STATUS_TOKEN\n",
    };
    if req.method() != hyper::Method::GET {
        return reply(StatusCode::METHOD_NOT_ALLOWED, "text/plain", what);
    }
    match (path, &page.metrics, &page.dashboard) {
        ("/metrics", Some(m), _) => metrics(req, m),
        (p, _, Some(d)) if p == DASHBOARD_PATH || p.starts_with("/dashboard/") => dashboard(req, d),
        _ => reply(StatusCode::NOT_FOUND, "text/plain", what),
    }
}

fn metrics(req: &Request<Incoming>, m: &Metrics) -> Response<Body> {
    if let Some(token) = &m.token {
        let given = req.headers().get(hyper::header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer "));
        if !given.is_some_and(|g| same(g.trim().as_bytes(), token.as_bytes())) {
            let mut r = reply(StatusCode::UNAUTHORIZED, "text/plain", "lazarus: this job's metrics need its bearer token\n");
            r.headers_mut().insert(hyper::header::WWW_AUTHENTICATE, hyper::header::HeaderValue::from_static("Bearer"));
            return r;
        }
    }
    reply(StatusCode::OK, "application/openmetrics-text; version=1.0.0; charset=utf-8", m.metrics.encode(m.status.as_ref()))
}

/// The page, its state (`/dashboard/state`) and its stream (`/dashboard/events`), to holders
/// of the job's status token.
fn dashboard(req: &Request<Incoming>, d: &Arc<Dashboard>) -> Response<Body> {
    if !d.admits(req.uri().query()) {
        return reply(
            StatusCode::UNAUTHORIZED,
            "text/plain",
            "lazarus: the dashboard needs the job's status token: /dashboard?token=TOKEN (as printed when the job starts)\n",
        );
    }
    let mut r = match req.uri().path() {
        DASHBOARD_PATH => reply(StatusCode::OK, "text/html; charset=utf-8", d.page()),
        "/dashboard/state" => reply(StatusCode::OK, "application/json", d.state(None).0),
        "/dashboard/events" => {
            let mut r = Response::new(d.stream().boxed());
            r.headers_mut().insert(hyper::header::CONTENT_TYPE, hyper::header::HeaderValue::from_static("text/event-stream"));
            r
        }
        _ => return reply(StatusCode::NOT_FOUND, "text/plain", "lazarus: the dashboard is at GET /dashboard?token=STATUS_TOKEN\n"),
    };
    // Read-only and the job's own: never kept by a cache, never framed by another site.
    let headers = r.headers_mut();
    headers.insert(hyper::header::CACHE_CONTROL, hyper::header::HeaderValue::from_static("no-store"));
    headers.insert(hyper::header::X_FRAME_OPTIONS, hyper::header::HeaderValue::from_static("DENY"));
    headers.insert(hyper::header::REFERRER_POLICY, hyper::header::HeaderValue::from_static("no-referrer"));
    r
}

/// Equal, in a time that does not depend on where they differ.
pub(crate) fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    fn get(addr: SocketAddr, head: &str) -> String {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.write_all(head.as_bytes()).unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    }

    /// The endpoint on a real socket: the text format, 404 elsewhere, 405 for another method,
    /// 401 without the token, and a scrape answered while silent connections are open.
    #[test]
    fn scrapes_are_answered_beside_silent_connections_and_need_the_token_where_one_is_set() {
        let at = MetricsEndpoint { listen: "127.0.0.1:0".parse().unwrap(), token: Some("s3cr3t".into()) };
        let server = MetricsServer::start(&at, Arc::new(JobMetrics::new()), None).unwrap();
        let addr = server.addr();
        let silent: Vec<std::net::TcpStream> = (0..300).map(|_| std::net::TcpStream::connect(addr).unwrap()).collect();
        let ok = get(addr, "GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer s3cr3t\r\n\r\n");
        assert!(ok.starts_with("HTTP/1.1 200") && ok.contains("# EOF"), "{ok}");
        for (head, want) in [
            ("GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", "HTTP/1.1 401"),
            ("GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer s3cr3u\r\n\r\n", "HTTP/1.1 401"),
            ("GET /other HTTP/1.1\r\nHost: x\r\n\r\n", "HTTP/1.1 404"),
            ("POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n", "HTTP/1.1 405"),
        ] {
            let got = get(addr, head);
            assert!(got.starts_with(want), "{head:?}: {got}");
        }
        drop(silent);
    }

    #[test]
    fn tokens_are_compared_whole() {
        assert!(same(b"abc", b"abc"));
        assert!(!same(b"abc", b"abd") && !same(b"abc", b"ab") && !same(b"", b"a"));
    }
}
