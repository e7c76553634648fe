//! Sampling a group's serving nodes through their management API.

use crate::metrics::{RampingService, SampleOut};
use futures_util::stream::{FuturesUnordered, StreamExt};
use futures_util::FutureExt;
use lbscale_descriptors::{raise_open_files_limit, Budget, Slot};
use lbscale_engine::nodeapi::stats::StatsClient;
use lbscale_engine::nodeapi::{EngineCredentials, NodeApiError};
use lbscale_engine::reconcile::GroupView;
use lbscale_engine::store::NodeRow;
use lbscale_proto::NodeStats;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The API port of a node whose handle does not say.
const DEFAULT_API_PORT: u16 = 9990;
/// Longest wait for one node's statistics (connect + call).
const STATS_TIMEOUT: Duration = Duration::from_secs(2);
/// Longest wait for a place for a new connection, before the node's own
/// [`STATS_TIMEOUT`] starts. Every place is given back within that timeout:
/// a call queued behind up to two rounds of dials to nodes that do not
/// answer (an AZ gone dark: they hold their places to the end) still gets
/// through; one further back says it found no place.
const PLACE_WAIT: Duration = Duration::from_secs(4);
/// A gRPC connection (to a node that does not offer the statistics call over
/// HTTP/1.1, an older `lbscale-node`) is kept between samples up to this
/// stats interval only: it holds tens of KiB while idle.
const KEEP_GRPC_UP_TO: Duration = Duration::from_secs(15);
/// Descriptors left to the rest of the daemon when it keeps node
/// connections (at most half of them): the store's connections, its
/// listener, and the connections of the evaluations in flight that could not
/// be kept.
const DESCRIPTORS_RESERVED: usize = 2048;

/// The descriptors the daemon spends on node connections, across its groups.
pub(crate) struct NodeConnections {
    /// The connections kept between samples: a slot each, as many as the
    /// process's descriptors allow once its soft limit is raised to its hard
    /// one, less [`DESCRIPTORS_RESERVED`] or half of them, whichever is less.
    /// Each holds a descriptor and its TLS session (a few KiB); a node whose
    /// connection is kept costs a write and a read per sample instead of a
    /// TCP connection and a TLS handshake.
    pub(crate) kept: Arc<Budget>,
    /// Past that limit, a node gets a connection for one sample, closed after
    /// it. Those open at once take half the reserve at most, so that many
    /// large groups sampled together cannot take the descriptors of the store
    /// and the listener: a dial waits for a place, up to [`PLACE_WAIT`].
    once: Arc<Semaphore>,
}

impl NodeConnections {
    pub(crate) fn new() -> NodeConnections {
        NodeConnections::within(raise_open_files_limit())
    }

    fn within(open_files: usize) -> NodeConnections {
        let kept = kept_within(open_files);
        NodeConnections {
            kept: Budget::new(kept),
            once: Arc::new(Semaphore::new(((open_files - kept) / 2).max(1))),
        }
    }

    /// The place of a new connection: a kept one while there is room, else a
    /// place for one sample, waited for.
    async fn place(&self) -> Place {
        if let Some(slot) = self.kept.take(1) {
            return Place::Kept(slot);
        }
        // `once` is never closed: an error cannot happen, and would only let
        // the dial go ahead without a place.
        Place::Once {
            _permit: self.once.clone().acquire_owned().await.ok(),
        }
    }
}

/// Where a connection counts among [`NodeConnections`], given back when it
/// is dropped (with the connection).
enum Place {
    Kept(Slot),
    Once {
        _permit: Option<OwnedSemaphorePermit>,
    },
}

/// The two gauges of kept connections in the Prometheus text exposition.
pub(crate) fn render_kept(keeping: &Budget) -> String {
    format!(
        "# HELP lbscale_node_connections_kept Node connections kept between samples.\n# TYPE lbscale_node_connections_kept gauge\nlbscale_node_connections_kept {}\n# HELP lbscale_node_connections_kept_limit The most node connections the daemon keeps (its descriptor limit less a reserve).\n# TYPE lbscale_node_connections_kept_limit gauge\nlbscale_node_connections_kept_limit {}\n",
        keeping.used(),
        keeping.limit()
    )
}

fn kept_within(open_files: usize) -> usize {
    open_files - DESCRIPTORS_RESERVED.min(open_files / 2)
}

/// A connection to one node's statistics, kept between evaluations. Boxed:
/// a group's map of them then holds a pointer per free slot, not a client.
pub(crate) struct CachedClient {
    addr: String,
    client: Box<StatsClient>,
    _kept: Slot,
}

/// One node as the daemon samples it.
pub(crate) struct Target {
    pub id: String,
    pub az: String,
    ip: String,
    port: u16,
}

/// What one evaluation saw of the group's nodes.
pub(crate) struct Sampled {
    pub targets: Vec<Target>,
    /// Statistics by node id, of the targets that answered.
    pub answers: HashMap<String, NodeStats>,
}

impl Sampled {
    fn answered_in<'a>(&'a self, az: &'a str) -> impl Iterator<Item = (&'a Target, &'a NodeStats)> {
        self.targets
            .iter()
            .filter(move |t| t.az == az)
            .filter_map(|t| self.answers.get(&t.id).map(|s| (t, s)))
    }

    /// The mean of the AZ's answers; `None` when no serving node answered.
    pub fn mean(&self, az: &str) -> Option<SampleOut> {
        let stats: Vec<&NodeStats> = self.answered_in(az).map(|(_, s)| s).collect();
        if stats.is_empty() {
            return None;
        }
        let n = stats.len() as f64;
        Some(SampleOut {
            cpu: stats.iter().map(|s| s.cpu_percent).sum::<f64>() / n,
            memory: stats.iter().map(|s| s.memory_percent).sum::<f64>() / n,
            throughput: stats.iter().map(|s| s.throughput_mbps).sum::<f64>() / n,
            nodes: stats.len() as u32,
        })
    }

    /// The AZ's services still ramping under slow start.
    pub fn slow_start(&self, az: &str) -> Vec<RampingService> {
        self.answered_in(az)
            .flat_map(|(t, s)| {
                s.services
                    .iter()
                    .filter(|x| x.in_slow_start)
                    .map(|x| RampingService {
                        node: t.id.clone(),
                        vserver: x.vserver.clone(),
                        service: x.service.clone(),
                        cap_per_second: x.cap_per_second,
                        requests_per_second: x.requests_per_second,
                    })
            })
            .collect()
    }
}

/// The serving nodes of `view`, at the API port their stored handle names.
pub(crate) fn targets(view: &GroupView, rows: &[NodeRow]) -> Vec<Target> {
    view.nodes
        .iter()
        .filter(|n| n.serving)
        .map(|n| {
            let port = rows
                .iter()
                .find(|r| r.id == n.id)
                .and_then(|r| r.handle.get("api_port"))
                .and_then(|p| p.as_u64())
                .and_then(|p| u16::try_from(p).ok())
                .filter(|p| *p != 0)
                .unwrap_or(DEFAULT_API_PORT);
            Target {
                id: n.id.clone(),
                az: n.availability_zone.clone(),
                ip: n.private_ip.clone(),
                port,
            }
        })
        .collect()
}

/// Asks every target for its statistics, concurrently, each bounded by
/// [`PLACE_WAIT`] for a place for a new connection (see [`ask`]), then
/// [`STATS_TIMEOUT`]: CPU, memory and throughput as their means over the last
/// `window` (the group's stats interval). Connections are kept for the next
/// evaluation while `conns` has room ([`KEEP_GRPC_UP_TO`] for gRPC ones).
/// New connections show the group's engine credentials `creds` (the
/// engine's, kept per group: `Engine::node_credentials`).
pub(crate) async fn sample(
    clients: &mut HashMap<String, CachedClient>,
    conns: &NodeConnections,
    targets: Vec<Target>,
    token: &str,
    creds: &Arc<EngineCredentials>,
    window: Duration,
) -> Sampled {
    // Forget the connections of nodes that left.
    clients.retain(|id, _| targets.iter().any(|t| &t.id == id));
    // The calls run inside the evaluation's own task, not a task each: at a
    // sample's few calls, a spawn, its wakeups and its join cost more than
    // the polls they would spread over the workers.
    let mut calls: FuturesUnordered<_> = targets
        .iter()
        .map(|t| {
            let addr = format!("{}:{}", t.ip, t.port);
            let cached = clients.remove(&t.id).filter(|c| c.addr == addr);
            // Boxed: a kept connection's socket holds the waker of the call
            // that last read it until the next sample, and with it that
            // call's task in `calls`; the task is then a pointer, not the
            // whole call (a few KiB per kept connection).
            Box::pin(async move {
                let r = ask(t, cached, conns, token, creds, window).await;
                (t, addr, r)
            })
        })
        .collect();
    let mut answers = HashMap::new();
    while let Some((t, addr, Answered { conn, answer })) = calls.next().await {
        // Kept whatever the answer, a refusal too, while it can carry the
        // next call; a connection not kept is closed at the end of this
        // pass, and gives its place back.
        if let Some((mut client, Place::Kept(_kept))) = conn {
            if client.reusable() && (client.lean() || window <= KEEP_GRPC_UP_TO) {
                client.probe_while_idle();
                clients.insert(
                    t.id.clone(),
                    CachedClient {
                        addr,
                        client,
                        _kept,
                    },
                );
            }
        }
        match answer {
            Ok(stats) => {
                answers.insert(t.id.clone(), stats);
            }
            Err(e) => tracing::debug!(node = %t.id, error = %e, "no statistics from node"),
        }
    }
    drop(calls);
    Sampled { targets, answers }
}

/// A node's stats call that panicked: logged as the bug it is, with what it
/// said, and counted as no answer.
fn panicked(node: &str, panic: Box<dyn std::any::Any + Send>) -> String {
    let said = panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_default();
    tracing::error!(node, panic = %said, "a node's stats call panicked");
    "the call panicked".to_string()
}

/// One target's statistics: over its kept connection when there is one,
/// else over a new one once `conns` gives it a place (waited for up to
/// [`PLACE_WAIT`]). The node then has [`STATS_TIMEOUT`] to answer: the wait
/// for a place is the daemon's, not the node's, and does not use up its time.
async fn ask(
    t: &Target,
    cached: Option<CachedClient>,
    conns: &NodeConnections,
    token: &str,
    creds: &Arc<EngineCredentials>,
    window: Duration,
) -> Answered {
    let via = match cached {
        Some(c) => Via::Kept(c),
        None => match tokio::time::timeout(PLACE_WAIT, conns.place()).await {
            Ok(place) => Via::New(place),
            Err(_) => {
                return Answered::failed(format!(
                    "no place for a new connection within {}s: the daemon's connections for one sample are all in use",
                    PLACE_WAIT.as_secs()
                ))
            }
        },
    };
    // A panic in one node's call (a bug its answer runs into) costs that
    // node's answer, not the evaluation: the other nodes' stats still count,
    // as when each call was a task of its own.
    let call = std::panic::AssertUnwindSafe(stats_of(t, via, token, creds, window))
        .catch_unwind()
        .map(|r| r.unwrap_or_else(|panic| Answered::failed(panicked(&t.id, panic))));
    tokio::time::timeout(STATS_TIMEOUT, call)
        .await
        .unwrap_or_else(|_| {
            Answered::failed(format!("no answer within {}s", STATS_TIMEOUT.as_secs()))
        })
}

/// What one stats call gave: the node's answer, and the connection it went
/// over unless that ended (its place with it); whether the connection can
/// carry another call is its `reusable()`.
struct Answered {
    conn: Option<(Box<StatsClient>, Place)>,
    answer: Result<NodeStats, String>,
}

impl Answered {
    /// No answer, and no connection left.
    fn failed(why: String) -> Answered {
        Answered {
            conn: None,
            answer: Err(why),
        }
    }
}

/// How a stats call reaches its node.
enum Via {
    /// The connection kept from the last sample.
    Kept(CachedClient),
    /// A new connection, in this place.
    New(Place),
}

/// One target's statistics over `via`. A kept connection that has ended is
/// replaced by a new one in its place.
async fn stats_of(
    t: &Target,
    via: Via,
    token: &str,
    creds: &Arc<EngineCredentials>,
    window: Duration,
) -> Answered {
    let place = match via {
        Via::Kept(c) => {
            let mut client = c.client;
            match client.stats_over(window).await {
                // The kept connection ended (the node restarted, or closed it
                // while idle): a new one, within the same timeout, in its place.
                Err(NodeApiError::Unreachable { .. }) => Place::Kept(c._kept),
                // The node answered (a refusal too: a new connection would
                // hear the same).
                answer => {
                    return Answered {
                        conn: Some((client, Place::Kept(c._kept))),
                        answer: answer.map_err(|e| e.to_string()),
                    }
                }
            }
        }
        Via::New(place) => place,
    };
    let mut client = match StatsClient::connect(creds, &t.ip, t.port, &t.id, token).await {
        Ok(c) => Box::new(c),
        Err(e) => return Answered::failed(e.to_string()),
    };
    match client.stats_over(window).await {
        // Ended (reset, closed, cut short): nothing left to keep.
        Err(e @ NodeApiError::Unreachable { .. }) => Answered::failed(e.to_string()),
        answer => Answered {
            conn: Some((client, place)),
            answer: answer.map_err(|e| e.to_string()),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kept_connections_are_counted_in_the_gauges() {
        let keeping = Budget::new(2);
        let a = keeping.take(1).expect("a first place");
        let b = keeping.take(1).expect("a second place");
        assert!(keeping.take(1).is_none(), "past the limit");
        assert!(render_kept(&keeping).contains("lbscale_node_connections_kept 2\n"));
        drop((a, b));
        let text = render_kept(&keeping);
        assert!(text.contains("lbscale_node_connections_kept 0\n"));
        assert!(text.contains("lbscale_node_connections_kept_limit 2\n"));
    }

    #[test]
    fn the_descriptor_limit_leaves_a_reserve() {
        let k = NodeConnections::new();
        assert_eq!(
            k.kept.limit(),
            kept_within(lbscale_descriptors::open_files_limit())
        );
        // A small limit still keeps half; a large one leaves the reserve.
        assert_eq!(kept_within(1024), 512);
        assert_eq!(kept_within(20_000), 17_952);
    }

    #[tokio::test]
    async fn past_the_kept_connections_a_dial_waits_for_a_place_within_the_reserve() {
        // 20 descriptors: 10 kept, and 5 for connections of one sample.
        let conns = NodeConnections::within(20);
        assert_eq!(conns.kept.limit(), 10);
        let mut kept = Vec::new();
        for _ in 0..10 {
            kept.push(conns.place().await);
        }
        assert!(kept.iter().all(|p| matches!(p, Place::Kept(_))));
        let mut once = Vec::new();
        for _ in 0..5 {
            once.push(conns.place().await);
        }
        assert!(once
            .iter()
            .all(|p| matches!(p, Place::Once { _permit: Some(_) })));
        let waiting = tokio::time::timeout(Duration::from_millis(50), conns.place()).await;
        assert!(waiting.is_err(), "a sixth dial waits for a place");
        once.pop();
        let next = tokio::time::timeout(Duration::from_secs(5), conns.place())
            .await
            .expect("a place given back is taken");
        assert!(matches!(next, Place::Once { _permit: Some(_) }));
        kept.pop();
        assert!(
            matches!(conns.place().await, Place::Kept(_)),
            "a kept place given back is a kept place again"
        );
    }

    fn target(id: &str, port: u16) -> Target {
        Target {
            id: id.into(),
            az: "a".into(),
            ip: "127.0.0.1".into(),
            port,
        }
    }

    /// A node's statistics over HTTP/1.1 and TLS, served as a node serves
    /// them, on 127.0.0.1: its first two calls refused (503, the connection
    /// kept open), the others answered. Counts the connections it accepts.
    async fn refusing_twice(secret: &str, id: &str) -> (u16, Arc<std::sync::atomic::AtomicUsize>) {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let node = lbscale_engine::nodeapi::auth::node_credentials(secret, id).unwrap();
        let config = lbscale_engine::nodeapi::node_server_config(
            &node.ca_pem,
            &node.cert_pem,
            &node.key_pem,
        )
        .unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (accepted, calls) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let counted = accepted.clone();
        let id = id.to_string();
        tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                counted.fetch_add(1, Ordering::SeqCst);
                let (acceptor, calls, id) = (acceptor.clone(), calls.clone(), id.clone());
                tokio::spawn(async move {
                    let Ok(tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let _ = lbscale_proto::stats_http::serve(tls, Duration::from_secs(60), |_| {
                        let refused = calls.fetch_add(1, Ordering::SeqCst) < 2;
                        let id = id.clone();
                        async move {
                            if refused {
                                lbscale_proto::stats_http::Reply::Refused(503, "busy".into())
                            } else {
                                lbscale_proto::stats_http::Reply::Stats(NodeStats {
                                    node_id: id,
                                    ..Default::default()
                                })
                            }
                        }
                    })
                    .await;
                });
            }
        });
        (port, accepted)
    }

    #[tokio::test]
    async fn a_connection_the_node_refused_a_call_on_is_kept_for_the_next() {
        use std::sync::atomic::Ordering::SeqCst;
        let secret = "group-secret";
        let (port, accepted) = refusing_twice(secret, "n1").await;
        let conns = NodeConnections::within(64);
        let creds = Arc::new(EngineCredentials::issue(secret).unwrap());
        let mut clients = HashMap::new();
        let window = Duration::from_secs(60);
        let nodes = || vec![target("n1", port)];
        // Refused on a new connection, then on the kept one: kept both times.
        for _ in 0..2 {
            let refused = sample(&mut clients, &conns, nodes(), secret, &creds, window).await;
            assert!(refused.answers.is_empty(), "the call is refused");
            assert_eq!(clients.len(), 1, "its connection is kept");
            assert_eq!(conns.kept.used(), 1, "in its kept place");
        }
        let next = sample(&mut clients, &conns, nodes(), secret, &creds, window).await;
        assert_eq!(
            next.answers.get("n1").map(|s| s.node_id.as_str()),
            Some("n1")
        );
        assert_eq!(accepted.load(SeqCst), 1, "every call over one connection");
    }

    /// Why `t`, with no kept connection, gave no statistics.
    async fn failed_ask(t: Target, conns: &NodeConnections) -> String {
        let creds = Arc::new(EngineCredentials::issue("secret").unwrap());
        let window = Duration::from_secs(60);
        match ask(&t, None, conns, "token", &creds, window).await.answer {
            Ok(_) => panic!("{} answered", t.id),
            Err(why) => why,
        }
    }

    #[tokio::test]
    async fn a_node_that_waited_for_a_place_still_has_its_whole_time_to_answer() {
        // 4 descriptors: 2 kept and 1 for one sample, all in use; the one
        // for one sample is given back after 2.5 s (a dial to a dark node
        // that timed out).
        let conns = NodeConnections::within(4);
        let _kept = (conns.place().await, conns.place().await);
        let once = conns.place().await;
        assert!(matches!(once, Place::Once { _permit: Some(_) }));
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(2_500)).await;
            drop(once);
        });
        // A node that is down: its port refuses connections.
        let down = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = down.local_addr().unwrap().port();
        drop(down);
        let said = failed_ask(target("down", port), &conns).await;
        assert!(
            said.contains("refused"),
            "after its wait for a place the call reached the node: {said}"
        );
    }

    #[tokio::test]
    async fn a_call_that_finds_no_place_in_time_says_so() {
        // Every place taken and none given back: the call gives up after
        // its wait (4 s of real time: tokio's paused clock would need its
        // test-util feature, another build of tokio), without dialing.
        let conns = NodeConnections::within(4);
        let _taken = (
            conns.place().await,
            conns.place().await,
            conns.place().await,
        );
        let said = failed_ask(target("n", 1), &conns).await;
        assert!(
            said.contains("no place for a new connection within 4s"),
            "{said}"
        );
    }
}
