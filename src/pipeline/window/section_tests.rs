//! The window section's tests: the summary section built, appended to and folded.

use super::*;
use crate::openai::ChatRequest;
use crate::pipeline::window::turns::split_turns;
use crate::pipeline::{Memo, Params, PipelineConfig};
use crate::synthetic;
use crate::tokens::{Encoding, TokenCounter};
use serde_json::json;

/// The section of the first `summarized` turns of `request`.
fn section_of(
    request: &ChatRequest,
    summarized: usize,
    config: &PipelineConfig,
    memo: &Memo,
) -> Section {
    let params = Params::from_config(config);
    let counter = TokenCounter::new(Encoding::O200kBase);
    let decided = Default::default();
    let cx = StageCx::test(
        (config, &params),
        &counter,
        memo,
        &request.messages,
        &decided,
    );
    let (head, turns) = split_turns(&request.messages);
    build(head, &turns[..summarized.min(turns.len())], false, &cx)
}

/// The ledger's tokens in a section.
fn ledger_tokens(section: &Section) -> usize {
    let counter = TokenCounter::new(Encoding::O200kBase);
    section
        .text
        .lines()
        .filter_map(|l| l.strip_prefix("- "))
        .map(|l| counter.text(l) + 2)
        .sum()
}

#[test]
fn consecutive_turns_keep_the_earlier_section_as_a_prefix() {
    let request = synthetic::conversation(30).unwrap();
    let config = PipelineConfig::default();
    let memo = Memo::default();
    let sections: Vec<Section> = (1..30)
        .map(|n| section_of(&request, n, &config, &memo))
        .collect();
    let mut extended = 0;
    for pair in sections.windows(2) {
        let (before, after) = (&pair[0], &pair[1]);
        if after.folds > before.folds {
            continue;
        }
        let stable = &before.text[..before.stable_len];
        assert!(
            after.text.starts_with(stable),
            "{stable}\n---\n{}",
            after.text
        );
        assert!(after.stable_len >= before.stable_len);
        extended += 1;
    }
    assert!(extended >= 20, "{extended} of 28 extended");
}

#[test]
fn a_cold_replica_builds_the_same_section() {
    let request = synthetic::conversation(24).unwrap();
    let config = PipelineConfig::default();
    let warm = Memo::default();
    for n in 1..24 {
        section_of(&request, n, &config, &warm);
    }
    let cold = section_of(&request, 23, &config, &Memo::default());
    assert_eq!(cold.text, section_of(&request, 23, &config, &warm).text);
}

#[test]
fn the_section_folds_within_its_cap_and_keeps_the_latest_values() {
    let request = synthetic::conversation(30).unwrap();
    let mut config = PipelineConfig::default();
    config.window.ledger_max_tokens = 120;
    let memo = Memo::default();
    let mut folds = 0;
    for n in 1..30 {
        let section = section_of(&request, n, &config, &memo);
        assert!(ledger_tokens(&section) <= 180, "{}", section.text);
        folds = section.folds;
    }
    assert!(folds >= 2, "{folds} folds");
    // The latest turn's reservation is in the ledger after every fold.
    let section = section_of(&request, 29, &config, &memo);
    assert!(section.text.contains("R31196"), "{}", section.text);
}

#[test]
fn summary_lines_come_after_the_ledger_and_stay_within_max_segments() {
    let request = synthetic::conversation(40).unwrap();
    let mut config = PipelineConfig::default();
    config.window.max_segments = 2;
    let memo = Memo::default();
    for n in 4..40 {
        let section = section_of(&request, n, &config, &memo);
        let lines: Vec<&str> = section.text.lines().collect();
        let summaries = lines.iter().filter(|l| l.starts_with("{\"turns\"")).count();
        assert_eq!(summaries, section.segment_lines);
        assert!(summaries <= 2, "{}", section.text);
        // After what stays: the last turn's answer, then the summary lines, which may change.
        let rest: Vec<&str> = section.text[section.stable_len..].lines().collect();
        let answer = rest.iter().take_while(|l| l.starts_with("- ")).count();
        assert!(rest[answer..].iter().all(|l| !l.starts_with("- ")));
    }
}

#[test]
fn a_value_is_said_once_and_blocks_follow_the_turns() {
    let request: ChatRequest = serde_json::from_value(json!({"model": "m", "messages": [
        {"role": "system", "content": "Agent for store S-1."},
        {"role": "user", "content": "I'm Daiki, zip 80298, order W9348897"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
            "function": {"name": "get_order_details", "arguments": "{\"order_id\": \"#W9348897\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "{\"order_id\": \"#W9348897\", \"status\": \"pending\", \"payment_method_id\": \"credit_card_8853416\"}"},
        {"role": "assistant", "content": "Your order #W9348897 is pending."},
        {"role": "user", "content": "Charge credit_card_8853416 for S-1, zip 80298 again"},
        {"role": "assistant", "content": "Done: charge ch_77 on credit_card_8853416."},
        {"role": "user", "content": "Thanks"}
    ]}))
    .unwrap();
    let config = PipelineConfig::default();
    let memo = Memo::default();
    let one = section_of(&request, 1, &config, &memo);
    let two = section_of(&request, 2, &config, &memo);
    assert_eq!(
        two.text,
        "<conversation_summary>\n\
         Identifiers from earlier turns, word for word:\n\
         - user: 80298, W9348897\n\
         - get_order_details(order_id: #W9348897) → order_id: #W9348897, payment_method_id: credit_card_8853416\n\
         - assistant: ch_77\n\
         Earlier turns, oldest first:\n\
         {\"turns\":\"1-2\",\"topic\":\"zip daiki\",\"discussed\":[\"order\",\"w9348897\",\"charge\",\"get_order_details\"],\"outcome\":\"Done: charge ch_77 on credit_card_8853416.\"}\n\
         </conversation_summary>"
    );
    assert!(two.text.starts_with(&one.text[..one.stable_len]));
}

#[test]
fn the_answer_kept_verbatim_is_not_repeated_until_it_is_summarized() {
    let request: ChatRequest = serde_json::from_value(json!({"model": "m", "messages": [
        {"role": "user", "content": "Order W9348897 please"},
        {"role": "assistant", "content": "It totals $481.50, pay with card_77?"},
        {"role": "user", "content": "Yes, card_77"},
        {"role": "assistant", "content": "Done, receipt R-55."},
        {"role": "user", "content": "Thanks"}
    ]}))
    .unwrap();
    let config = PipelineConfig::default();
    let params = Params::from_config(&config);
    let counter = TokenCounter::new(Encoding::O200kBase);
    let memo = Memo::default();
    let decided = Default::default();
    let messages = &request.messages;
    let cx = StageCx::test((&config, &params), &counter, &memo, messages, &decided);
    let (head, turns) = split_turns(&request.messages);
    let kept = build(head, &turns[..1], true, &cx);
    assert!(!kept.text.contains("- assistant:"), "{}", kept.text);
    let summarized = build(head, &turns[..1], false, &cx);
    assert!(summarized.text.contains("- assistant: $481.50, card_77\n"));
    // The next turn's block starts with those lines: the section so far stays a prefix.
    let next = build(head, &turns[..2], true, &cx);
    assert!(
        next.text
            .starts_with(&summarized.text[..summarized.stable_len])
    );
    assert!(!next.text.contains("- assistant: R-55"), "{}", next.text);
    assert!(next.text.contains("- assistant: $481.50, card_77\n"));
}

/// `shows` as it first was: every occurrence `str::match_indices` finds, checked at its ends.
fn shows_by_match_indices(text: &str, value: &str) -> bool {
    let part_of_word = |c: Option<char>| c.is_some_and(|c| c.is_alphanumeric() || c == '_');
    !value.is_empty()
        && text.match_indices(value).any(|(at, _)| {
            !part_of_word(text[..at].chars().next_back())
                && !part_of_word(text[at + value.len()..].chars().next())
        })
}

#[test]
fn a_value_is_shown_whole_only() {
    let added = Shows::new("- order #W123 for zb-b-b, port 8000:8000 (é_1)\n");
    for (value, shown) in [
        ("W123", true),
        ("W12", false),
        ("123", false),
        ("8000:8000", true),
        ("8000", true),
        // Its first occurrence follows `z`, and the next one overlaps it: never looked at.
        ("b-b", false),
        ("b-b,", true),
        ("zb", true),
        ("é_1", true),
        ("_1", false),
        ("", false),
    ] {
        assert_eq!(added.shows(value), shown, "{value}");
        assert_eq!(shows_by_match_indices(added.text, value), shown, "{value}");
    }
}

proptest::proptest! {
    /// Words looked up and values searched for give what every occurrence checked gave, on
    /// texts and values over an alphabet of word characters, separators and a multi-byte letter.
    #[test]
    fn shows_agrees_with_every_occurrence_checked(
        text in "[ab1_ é:-]{0,40}",
        value in "[ab1_ é:-]{0,6}",
    ) {
        let added = Shows::new(&text);
        proptest::prop_assert_eq!(added.shows(&value), shows_by_match_indices(&text, &value));
        // A value cut from the text itself, so that occurrences are common.
        let chars: Vec<char> = text.chars().collect();
        for start in 0..chars.len() {
            for end in start..chars.len().min(start + 6) {
                let cut: String = chars[start..=end].iter().collect();
                proptest::prop_assert_eq!(added.shows(&cut), shows_by_match_indices(&text, &cut));
            }
        }
    }
}

#[test]
fn a_block_adds_each_identifier_its_lines_show_and_the_ledger_did_not() {
    let request = synthetic::conversation(12).unwrap();
    let config = PipelineConfig::default();
    let params = Params::from_config(&config);
    let counter = TokenCounter::new(Encoding::O200kBase);
    let memo = Memo::default();
    let decided = Default::default();
    let cx = StageCx::test(
        (&config, &params),
        &counter,
        &memo,
        &request.messages,
        &decided,
    );
    let (_, turns) = split_turns(&request.messages);
    let removed = removed_of(&turns[..8]);
    let ids: Vec<String> = removed
        .iter()
        .flat_map(|(_, m)| message_ids(m, &cx).all.clone())
        .collect();
    // One value the ledger already shows.
    let shown: HashSet<String, foldhash::fast::RandomState> = ids[..1].iter().cloned().collect();
    let block = block(&removed, &shown, config.window.ledger_max_tokens, &cx);
    assert!(!block.lines.is_empty());
    assert_eq!(block.tokens, lines_tokens(&block.lines, &cx));

    // Every occurrence of every identifier, checked one by one.
    let mut text = String::new();
    for line in &block.lines {
        push_line(&mut text, line);
    }
    let added = Shows::new(&text);
    let expected: HashSet<&str> = ids
        .iter()
        .filter(|v| !shown.contains(*v) && added.shows(v))
        .map(String::as_str)
        .collect();
    let found: HashSet<&str> = block.found.iter().map(String::as_str).collect();
    assert_eq!(found.len(), block.found.len(), "each value once");
    assert_eq!(found, expected);
    assert!(!found.is_empty() && !found.contains(ids[0].as_str()));
}
