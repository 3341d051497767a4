//! Lists of rows sent as tables: a query result or a listing says its field names once
//! instead of once per row, every value kept. Pure.

use std::collections::HashSet;

use serde_json::{Map, Value};

/// Rows a list needs to be sent as a table.
const MIN_TABLE_ROWS: usize = 3;

/// Lists of objects that share their fields (query results, listings) as tables, every value
/// kept: `{"columns": ["id", "avg"], "rows": [[1, "29.1"], [2, "34.6"]]}`. The field names are
/// said once instead of once per row. A field a row lacks (a null the compaction dropped) is
/// `null` in that row; lists whose items share less than half their fields stay lists.
pub(super) fn tabulated(value: Value) -> Value {
    match value {
        Value::Object(mut map) => {
            // In place: collecting into a new map would hash every key again.
            for field in map.values_mut() {
                *field = tabulated(std::mem::take(field));
            }
            Value::Object(map)
        }
        Value::Array(items) => {
            let items: Vec<Value> = items.into_iter().map(tabulated).collect();
            match columns_of(&items) {
                Some(columns) => table(columns, items),
                None => Value::Array(items),
            }
        }
        scalar => scalar,
    }
}

/// Columns a table has at most: wider lists stay lists (and reading them stays linear).
const MAX_COLUMNS: usize = 64;

/// The columns of a list of objects, in order of first appearance, when it reads as a table.
fn columns_of(items: &[Value]) -> Option<Vec<String>> {
    if items.len() < MIN_TABLE_ROWS {
        return None;
    }
    let mut columns: Vec<String> = Vec::new();
    let mut seen: HashSet<&str, foldhash::fast::RandomState> = HashSet::default();
    for item in items {
        for key in item.as_object()?.keys() {
            if seen.insert(key) {
                if columns.len() == MAX_COLUMNS {
                    return None;
                }
                columns.push(key.clone());
            }
        }
    }
    let full = items
        .iter()
        .filter_map(Value::as_object)
        .all(|row| row.len() * 2 >= columns.len());
    (columns.len() >= 2 && full).then_some(columns)
}

fn table(columns: Vec<String>, items: Vec<Value>) -> Value {
    let rows: Vec<Value> = items
        .into_iter()
        .map(|item| match item {
            Value::Object(mut row) => Value::Array(
                columns
                    .iter()
                    .map(|c| row.remove(c).unwrap_or(Value::Null))
                    .collect(),
            ),
            other => other,
        })
        .collect();
    let mut out = Map::new();
    out.insert(
        "columns".to_owned(),
        Value::Array(columns.into_iter().map(Value::String).collect()),
    );
    out.insert("rows".to_owned(), Value::Array(rows));
    Value::Object(out)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn rows_become_a_table_with_every_value() {
        let rows = json!({"result": [
            {"department": "Finance", "avg": "35.8", "staff": 12437},
            {"department": "Sales", "avg": "34.6", "staff": 37701},
            {"department": "Research", "staff": 15441},
        ]});
        assert_eq!(
            tabulated(rows),
            json!({"result": {"columns": ["department", "avg", "staff"], "rows": [
                ["Finance", "35.8", 12437], ["Sales", "34.6", 37701], ["Research", null, 15441],
            ]}})
        );
    }

    #[test]
    fn rows_with_ever_new_fields_stay_a_list() {
        let rows: Vec<Value> = (0..5_000).map(|i| json!({format!("k{i}"): i})).collect();
        let rows = Value::Array(rows);
        assert_eq!(tabulated(rows.clone()), rows);
    }

    #[test]
    fn short_or_mixed_lists_stay_lists() {
        let two = json!([{"a": 1, "b": 2}, {"a": 3, "b": 4}]);
        assert_eq!(tabulated(two.clone()), two);
        let mixed = json!([{"a": 1, "b": 2}, {"c": 3, "d": 4}, {"e": 5, "f": 6}]);
        assert_eq!(tabulated(mixed.clone()), mixed);
        let scalars = json!([1, 2, 3, {"a": 1}]);
        assert_eq!(tabulated(scalars.clone()), scalars);
    }
}
