//! Counting what the store holds: how the tests prove that a destroy left
//! nothing behind.

use super::*;

impl Store {
    /// Rows in one of the store's tables (tests use it to prove a clean destroy).
    pub fn count_rows(&self, table: &str) -> Result<i64> {
        const TABLES: &[&str] = &[
            "distributors",
            "groups",
            "group_secrets",
            "se_groups",
            "vservers",
            "nodes",
            "addresses",
            "events",
            "leases",
            "policy_state",
            "vserver_spans",
        ];
        if !TABLES.contains(&table) {
            return Err(StoreError::Sql(format!("no table {table:?}")));
        }
        self.with(|c| c.int(&format!("SELECT count(*) FROM {table}"), &[]))
    }

    /// Counts rows that mention the id anywhere (used by tests to prove a
    /// clean destroy), in one statement.
    pub fn rows_mentioning(&self, id: &str) -> Result<i64> {
        let mut counts: Vec<String> = [
            ("distributors", "id"),
            ("groups", "id"),
            ("groups", "distributor_id"),
            ("group_secrets", "group_id"),
            ("se_groups", "id"),
            ("se_groups", "group_id"),
            ("vservers", "id"),
            ("vservers", "se_group_id"),
            ("nodes", "group_id"),
            ("events", "group_id"),
            ("leases", "group_id"),
            ("policy_state", "group_id"),
            ("addresses", "owner"),
        ]
        .iter()
        .map(|(table, col)| format!("(SELECT count(*) FROM {table} WHERE {col} = ?1)"))
        .collect();
        // A daemon's claim on a group is a lease keyed `daemon/<group>`, its AZ
        // workflows' leases `<group>/az/<az>`.
        counts.push("(SELECT count(*) FROM leases WHERE group_id = ?2 OR group_id LIKE ?3)".into());
        let sql = format!("SELECT {}", counts.join(" + "));
        self.with(|c| c.int(&sql, vals![id, daemon_claim_key(id), az_lease_key(id, "%")]))
    }
}
