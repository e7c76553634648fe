//! Crash injection for the fault-injection tests (a test hook, not a feature).
//!
//! `LBSCALE_FAULT=<point>` in the environment of a process that runs the engine
//! (the daemon, in the tests) makes that process abort — no cleanup, no unwinding,
//! like SIGKILL — when a workflow reaches the named point. The points sit between
//! two durable steps of scale-out / scale-in, so that the tests can prove that
//! the next run resumes at the right step:
//!
//! | point | where |
//! |---|---|
//! | `after_node_row` | node row inserted, process not started |
//! | `after_provision` | process up, row not yet `joining` |
//! | `after_configure` | configuration pushed, row not yet `active` |
//! | `after_register` | registered in the store, not yet published |
//! | `after_deregister` | deregistered in the store, not yet published |
//! | `after_drain` | drained (row `deprovisioning`), process still up |
//! | `after_deprovision_before_delete` | process gone, row not yet deleted |
//!
//! Unset, empty, or naming no point: every [`fault_point`] is a no-op. Nothing
//! but an explicit, exact variable value reaches the abort.

use std::sync::OnceLock;

/// The environment variable that names the point at which to abort.
pub const FAULT_ENV: &str = "LBSCALE_FAULT";

/// Every point a workflow passes (the values [`FAULT_ENV`] accepts).
pub const FAULT_POINTS: [&str; 7] = [
    "after_node_row",
    "after_provision",
    "after_configure",
    "after_register",
    "after_deregister",
    "after_drain",
    "after_deprovision_before_delete",
];

/// Aborts the process when [`FAULT_ENV`] names `point` exactly; a no-op otherwise.
pub fn fault_point(point: &'static str) {
    static ARMED: OnceLock<Option<String>> = OnceLock::new();
    debug_assert!(FAULT_POINTS.contains(&point), "unknown fault point {point}");
    let armed = ARMED.get_or_init(|| {
        std::env::var(FAULT_ENV)
            .ok()
            .filter(|v| FAULT_POINTS.contains(&v.as_str()))
    });
    if armed.as_deref() == Some(point) {
        eprintln!("{FAULT_ENV}={point}: aborting here (test hook)");
        std::process::abort();
    }
}

/// Places where a test holds a workflow (not aborts it) to make a race
/// deterministic, with the `testing` feature only; elsewhere [`hold_point`] is
/// a no-op. A test arms a point for one group with [`hold`], waits until a
/// workflow of that group [`Held::reached`] it, acts, and lets the workflow
/// go on. Points are per group so that tests running at once, each on its
/// own group, never stop each other's workflows.
#[cfg(feature = "testing")]
pub mod holds {
    use std::collections::BTreeMap;
    use std::sync::{Arc, Mutex};
    use tokio::sync::Notify;

    #[derive(Default)]
    struct Point {
        reached: Notify,
        released: Notify,
    }

    type Key = (&'static str, String);

    fn points() -> &'static Mutex<BTreeMap<Key, Arc<Point>>> {
        static POINTS: std::sync::OnceLock<Mutex<BTreeMap<Key, Arc<Point>>>> =
            std::sync::OnceLock::new();
        POINTS.get_or_init(Default::default)
    }

    /// An armed point: the next workflow of its group to reach it waits until
    /// released.
    pub struct Held {
        key: Key,
        point: Arc<Point>,
    }

    /// Arms `name` for the next workflow of group `group_id` that reaches it.
    pub fn hold(name: &'static str, group_id: &str) -> Held {
        let point = Arc::new(Point::default());
        let key = (name, group_id.to_string());
        points().lock().unwrap().insert(key.clone(), point.clone());
        Held { key, point }
    }

    impl Held {
        /// Returns once a workflow waits at the point.
        pub async fn reached(&self) {
            self.point.reached.notified().await;
        }
        /// Lets the waiting workflow go on (and disarms the point, if no
        /// workflow reached it).
        pub fn release(self) {
            points().lock().unwrap().remove(&self.key);
            self.point.released.notify_one();
        }
    }

    /// Disarmed as it is reached: only the first workflow there waits.
    pub(crate) async fn wait_at(name: &'static str, group_id: &str) {
        let point = points()
            .lock()
            .unwrap()
            .remove(&(name, group_id.to_string()));
        if let Some(p) = point {
            p.reached.notify_one();
            p.released.notified().await;
        }
    }
}

/// Where a test may hold a workflow of group `_group_id` (see `holds`, with
/// the `testing` feature).
pub(crate) async fn hold_point(_name: &'static str, _group_id: &str) {
    #[cfg(feature = "testing")]
    holds::wait_at(_name, _group_id).await;
}
