//! Errors about the whole input document name it (`input`), as docs/cli.md requires of
//! every one-line error: `error: input: must be an object, got [1,2]`.

use lbscale_core::{simulate, slowstart};
use serde_json::json;

#[test]
fn simulate_root_that_is_not_an_object_is_named_input() {
    let e = simulate::simulate_json(&json!([1, 2])).unwrap_err();
    assert!(
        e.path.is_empty(),
        "the structured path is the root: {:?}",
        e.path
    );
    assert_eq!(e.path_string(), "input");
    assert_eq!(e.to_string(), "input: must be an object, got [1,2]");
    for doc in [json!("x"), json!(3), json!(null)] {
        let e = simulate::simulate_json(&doc).unwrap_err().to_string();
        assert!(e.starts_with("input: must be an object, got "), "{e}");
    }
}

#[test]
fn slowstart_root_that_is_not_an_object_is_named_input() {
    let e = slowstart::simulate_json(&json!([1, 2])).unwrap_err();
    assert_eq!(e.to_string(), "input: must be an object, got [1,2]");
}

#[test]
fn fields_under_the_root_keep_their_plain_names() {
    let e = simulate::simulate_json(&json!({"until": 60})).unwrap_err();
    assert_eq!(e.to_string(), "group: must be set, got nothing");
    let e = simulate::simulate_json(&json!({"bogus": 1})).unwrap_err();
    assert!(
        e.to_string()
            .starts_with("bogus: must be one of the known fields"),
        "{e}"
    );
}

/// A bad setting of the `group` object is refused with its path.
#[test]
fn a_groups_policy_setting_is_refused_with_its_path() {
    let group = json!({
        "availability_zones": ["az1"],
        "min_nodes": 1, "max_nodes": 3, "stats_interval": "2s", "watch_time": "5s",
        "cooldown": "10s", "drain_timeout": "1m", "distributor": "dns", "dns_ttl": "5s",
        "thresholds": [{"metric": "cpu", "min": 10, "max": 80}],
    });
    let mut doc = json!({"group": group, "samples": [], "until": 1});
    let e = simulate::parse_input(&doc).unwrap_err();
    assert_eq!(
        e.to_string(),
        "group.watch_time: must be a positive multiple of stats_interval (2s), got 5s"
    );
    doc["group"]["watch_time"] = json!("6s");
    doc["group"]["cooldown"] = json!("soon");
    let e = simulate::parse_input(&doc).unwrap_err().to_string();
    assert!(e.starts_with("group.cooldown: "), "{e}");
}
