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

/// The daemon reads a group's policy with the conversion `lbscale simulate`
/// uses: the same values, and a bad setting refused in the same words (its
/// path relative to the group).
#[test]
fn a_groups_policy_reads_as_simulate_reads_it() {
    let group = json!({
        "min_nodes": 1, "max_nodes": 3, "stats_interval": "2s", "watch_time": "6s",
        "cooldown": "10s", "drain_timeout": "1m", "distributor": "dns", "dns_ttl": "5s",
        "thresholds": [{"metric": "cpu", "min": 10, "max": 80}],
    });
    let (cfg, initial) = simulate::group_policy(&group).unwrap();
    assert_eq!(initial, 1);
    assert_eq!((cfg.stats_interval, cfg.watch_samples), (2_000, 3));
    assert_eq!(
        (cfg.cooldown, cfg.drain_timeout, cfg.dns_ttl),
        (10_000, 60_000, 5_000)
    );
    let mut doc = json!({"group": group.clone(), "samples": [], "until": 1});
    doc["group"]["availability_zones"] = json!(["az1"]);
    let input = simulate::parse_input(&doc).unwrap();
    assert_eq!(input.policy, cfg, "simulate reads the same policy");

    let mut bad = group.clone();
    bad["watch_time"] = json!("5s");
    let e = simulate::group_policy(&bad).unwrap_err();
    assert_eq!(
        e.to_string(),
        "watch_time: must be a positive multiple of stats_interval (2s), got 5s"
    );
    doc["group"]["watch_time"] = json!("5s");
    let e = simulate::parse_input(&doc).unwrap_err();
    assert_eq!(
        e.to_string(),
        "group.watch_time: must be a positive multiple of stats_interval (2s), got 5s"
    );
    bad = group.clone();
    bad["cooldown"] = json!("soon");
    let e = simulate::group_policy(&bad).unwrap_err().to_string();
    assert!(e.starts_with("cooldown: "), "{e}");
}
