//! The compaction's tests: clearing, JSON and text compaction, stubs and handles.

use serde_json::json;

use super::*;
use crate::pipeline::{Params, PipelineConfig};
use crate::tokens::Encoding;

fn keep() -> HashSet<&'static str> {
    [
        "name",
        "full_name",
        "id",
        "html_url",
        "description",
        "title",
    ]
    .into_iter()
    .collect()
}

fn pruning<'a>(keep: &'a HashSet<&'a str>) -> Rules<'a> {
    Rules {
        keep: Some(keep),
        max_string_chars: 300,
        list_cap: usize::MAX,
        keep_cut_identifiers: false,
    }
}

#[test]
fn json_keeps_identifying_fields_flattens_logins_and_keeps_every_identifier() {
    let repo = json!({"id": 1296269, "name": "Hello-World", "full_name": "octocat/Hello-World",
        "owner": {"login": "octocat", "id": 1, "avatar_url": "https://x"}, "private": false,
        "html_url": "https://github.com/octocat/Hello-World", "description": null,
        "forks_url": "https://api.github.com/repos/octocat/Hello-World/forks", "size": 108,
        "pushed_at": "2011-01-26T19:06:43Z", "visibility": "public"});
    let keep = keep();
    let out = compact_value(&repo, &pruning(&keep));
    assert_eq!(
        out,
        json!({"id": 1296269, "name": "Hello-World", "full_name": "octocat/Hello-World",
        "owner": "octocat", "html_url": "https://github.com/octocat/Hello-World",
        "size": 108, "pushed_at": "2011-01-26T19:06:43Z"})
    );
}

#[test]
fn lossless_compaction_keeps_every_identifier_and_number() {
    let order = json!({"order_id": "#W9348897", "note": null, "tags": [],
        "items": [{"item_id": "6117189161", "price": 481.5, "qty": 1, "available": true,
            "review": "word ".repeat(100)}]});
    let out = compact_value(&order, &Rules::lossless(300));
    assert_eq!(out["order_id"], "#W9348897");
    assert_eq!(out["items"][0]["item_id"], "6117189161");
    assert_eq!(out["items"][0]["price"], 481.5);
    assert_eq!(out["items"][0]["qty"], 1);
    assert_eq!(out["items"][0]["available"], true);
    assert!(out.get("note").is_none() && out.get("tags").is_none());
    assert!(out["items"][0]["review"].as_str().unwrap().ends_with(" …"));
}

#[test]
fn lists_are_cut_by_whole_items_to_fit_and_name_what_they_left_out() {
    let counter = TokenCounter::new(Encoding::O200kBase);
    let items: Vec<Value> = (0..200)
        .map(|i| json!({"id": i, "name": format!("repo-{i}"), "junk": "x".repeat(50)}))
        .collect();
    let params = Params::from_config(&PipelineConfig::default());
    let out = compact_json_to_fit(&Value::Array(items), &keep(), 300, &params, &counter);
    assert!(counter.text(&out) <= 300, "{out}");
    let parsed: Vec<Value> = serde_json::from_str(&out).unwrap();
    let marker = parsed.last().unwrap().as_str().unwrap();
    assert!(marker.starts_with("(showing "), "{marker}");
    assert!(
        marker.contains(" of 200; identifiers in the others: "),
        "{marker}"
    );
    assert_eq!(parsed[0], json!({"id": 0, "name": "repo-0"}));
}

#[test]
fn json_is_minified_byte_for_byte() {
    let text = "{\"order_id\": \"#W1\", \"price\": 481.50, \"note\": \"a \\\" b  c\",\n \"items\": [1, 2]}";
    let out = minified(text).unwrap();
    assert_eq!(
        out,
        "{\"order_id\":\"#W1\",\"price\":481.50,\"note\":\"a \\\" b  c\",\"items\":[1,2]}"
    );
    let same: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(same, serde_json::from_str::<Value>(text).unwrap());
    assert_eq!(minified("{\"a\":1}"), None);
    assert_eq!(minified("not json: {\"a\": 1}"), None);
    assert_eq!(minified("{\"a\": 1"), None);
}

#[test]
fn prose_is_cut_at_whitespace_identifiers_never() {
    let long = format!(
        "{} https://example.com/a/very/long/path/that/must/not/change end",
        "word ".repeat(70)
    );
    let keep = keep();
    let out = compact_value(&Value::String(long.clone()), &pruning(&keep));
    let out = out.as_str().unwrap();
    assert!(out.ends_with(" …"));
    for id in identifiers(out) {
        assert!(long.contains(&id));
    }
    let url = "https://example.com/".repeat(30);
    assert_eq!(compact_value(&json!(url), &pruning(&keep)), json!(url));
}

#[test]
fn text_keeps_head_and_tail_and_lists_middle_identifiers() {
    let counter = TokenCounter::new(Encoding::O200kBase);
    let lines: Vec<String> = (0..400)
        .map(|i| format!("line {i}: build step ok id=STEP{i:04}"))
        .collect();
    let out = compact_text(&lines.join("\n"), 200, MAX_OMITTED_IDS, &counter);
    assert!(out.starts_with("line 0:"));
    assert!(out.ends_with("line 399: build step ok id=STEP0399"));
    assert!(out.contains("lines omitted; identifiers in them: "));
    assert!(counter.text(&out) < 400);
}

fn call(name: &str, arguments: &str) -> ToolCall {
    serde_json::from_value(json!({"id": "c1", "type": "function",
        "function": {"name": name, "arguments": arguments}}))
    .unwrap()
}

#[test]
fn a_stub_names_the_call_and_lists_what_the_result_held() {
    let counter = TokenCounter::new(Encoding::O200kBase);
    let call = call("get_order_details", r##"{"order_id": "#W9348897"}"##);
    let result = r##"{"order_id": "#W9348897", "status": "pending", "items": [{"name": "Action Camera", "item_id": "6117189161", "price": 481.5, "color": "silver"}, {"name": "Desk Lamp", "item_id": "7453605304", "price": 150.01, "color": "silver"}], "payment_method_id": "credit_card_8853416"}"##;
    assert_eq!(
        stub(Some(&call), result, 200, &TaskWords::default(), &counter),
        "[get_order_details(order_id: #W9348897) result cleared; it held: order_id: #W9348897, items: [name: Action Camera, item_id: 6117189161, price: 481.5; name: Desk Lamp, item_id: 7453605304, price: 150.01], payment_method_id: credit_card_8853416]"
    );
    // Bounded: cut between two values.
    let short = stub(Some(&call), result, 30, &TaskWords::default(), &counter);
    assert!(counter.text(&short) <= 30, "{short}");
    assert!(
        short.ends_with(" …]") && short.contains("order_id: #W9348897"),
        "{short}"
    );
    // Text results list their identifiers; a result without any keeps its first line.
    assert_eq!(
        stub(
            None,
            "Booked HAT045 for 2024-05-01\nok",
            200,
            &TaskWords::default(),
            &counter
        ),
        "[Previous result cleared; it held: HAT045, 2024-05-01]"
    );
    assert_eq!(
        stub(
            None,
            "{\n  \"done\": true\n}",
            200,
            &TaskWords::default(),
            &counter
        ),
        "[Previous result cleared: \"done\": true]"
    );
}

#[test]
fn a_catalog_too_long_for_its_stub_keeps_the_names_the_task_says() {
    let counter = TokenCounter::new(Encoding::O200kBase);
    let call = call("get_category_actions", r#"{"category_names": ["PULLS"]}"#);
    let filler = (0..120).map(|i| format!("list_hooks_{}", "abcdefghij".repeat(i % 3 + 1)));
    let mut names: Vec<String> = filler.collect();
    names.insert(90, "submit_review".to_owned());
    let result = json!({"category_actions": {"PULLS": names}}).to_string();
    let messages = [Message::text(
        Role::User,
        "Open the pull request and submit a review",
    )];
    let task = TaskWords::of(&messages, Some(&call));
    let stub = stub(Some(&call), &result, 60, &task, &counter);
    assert_eq!(
        stub,
        "[get_category_actions(category_names: [PULLS]) result cleared; it held: category_actions: {PULLS: [submit_review]} …]"
    );
    // Without the task, the start is kept and the name is gone.
    let blind = super::stub(Some(&call), &result, 60, &TaskWords::default(), &counter);
    assert!(
        !blind.contains("submit_review") && blind.ends_with(" …]"),
        "{blind}"
    );
}
