//! A request whose history lives upstream (a chained Responses request: `previous_response_id`
//! or `conversation`): only the new input is seen, and only that is rewritten. A cut tool
//! result has no way back here (no stub, no recall tool), so the only change to the input is one
//! that loses nothing: a text result holding JSON is sent without the whitespace between its
//! tokens, byte for byte otherwise. Everything else goes as the client sent it, and no context
//! is added: no summary, ledger or definition. The tools go as the client wrote them, or, along
//! a `previous_response_id` chain whose previous request sent a block of its own (stubs), as that
//! block (`tools::chain`): the same bytes along the chain either way.

use std::borrow::Cow;

use super::compact;
use super::prefix::AppendDetails;
use super::report::{PipelineReport, StageDetails, StageReport};
use super::stage::StageName;
use super::tools::chain::ChainTools;
use super::{Env, Rewrite, with_messages};
use crate::openai::{ChatRequest, Message};

/// The rewrite of what `request` sends, with the block of its chain (`chain`) when the tools
/// stage is on. The budget is not applied: the upstream holds the rest of the context, which
/// the proxy cannot judge, so the request always fits.
pub fn run(request: &ChatRequest, env: &Env<'_>, chain: Option<&ChainTools>) -> Rewrite {
    let counter = env.counter;
    let tokens_before = counter.request(request);
    let mut compacted = 0;
    let enabled = env.config.compact.enabled;
    let messages: Vec<Message> = request
        .messages
        .iter()
        .map(
            |message| match compact::minified_result(message).filter(|_| enabled) {
                Some(smaller) => {
                    compacted += 1;
                    smaller
                }
                None => message.clone(),
            },
        )
        .collect();
    let (sent, tokens_after) = if compacted > 0 {
        let sent = with_messages(Cow::Borrowed(request), messages);
        let tokens = counter.request(&sent);
        (sent, tokens)
    } else {
        (request.clone(), tokens_before)
    };
    let applied = tokens_after < tokens_before;
    let appended = if applied { tokens_after } else { tokens_before };
    let mut stages = vec![StageReport {
        stage: StageName::Append,
        tokens_before,
        tokens_after: appended,
        applied,
        details: StageDetails::Append(AppendDetails {
            appended: request.messages.len(),
            compacted,
        }),
    }];
    let mut sent = if applied { sent } else { request.clone() };
    let block = chain
        .filter(|_| env.config.tools.enabled)
        .and_then(|chain| chain.block_for(request));
    if let Some((tools, details)) = block {
        sent.tools = crate::openai::Nullable::Value(tools);
        stages.push(StageReport {
            stage: StageName::Tools,
            tokens_before: appended,
            tokens_after: counter.request(&sent),
            applied: true,
            details: StageDetails::Tools(details),
        });
    }
    let tokens_after = stages.last().map_or(tokens_before, |s| s.tokens_after);
    Rewrite {
        request: sent,
        report: PipelineReport {
            tokens_before,
            tokens_after,
            stages,
            budget: env.budget,
            fits: true,
            over_budget: None,
            prefix: None,
        },
        remember: None,
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::openai::{Content, ContentPart, Nullable, Role};
    use crate::pipeline::{Memo, PipelineConfig};
    use crate::tokens::{Encoding, TokenCounter};

    fn request() -> ChatRequest {
        let rows: Vec<_> = (0..20)
            .map(|i| json!({"id": format!("R{i}"), "avg": i as f64 / 3.0}))
            .collect();
        let mut body = json!({
            "model": "gpt-5",
            "messages": [
                {"role": "tool", "tool_call_id": "call_up", "content": serde_json::to_string_pretty(&rows).unwrap()},
                {"role": "user", "content": "And the next ones?"}
            ],
            "tools": [{"type": "function", "function": {"name": "query", "parameters": {"type": "object"}}}]
        });
        body["previous_response_id"] = json!("resp_1");
        ChatRequest::parse(body.to_string().as_bytes()).expect("a request")
    }

    fn env<'a>(config: &'a PipelineConfig, counter: &'a TokenCounter, memo: &'a Memo) -> Env<'a> {
        Env {
            config,
            counter,
            memo,
            budget: 10,
            sticky_categories: &[],
            reinforcement: None,
            remembered: None,
        }
    }

    #[test]
    fn what_is_seen_is_compacted_and_nothing_is_added_or_left_out() {
        let (config, memo) = (PipelineConfig::default(), Memo::default());
        let counter = TokenCounter::new(Encoding::O200kBase);
        let env = env(&config, &counter, &memo);
        let client = request();
        let rewrite = run(&client, &env, None);
        let sent = &rewrite.request;
        assert_eq!(sent.messages.len(), 2);
        assert_eq!(sent.messages[1], client.messages[1]);
        assert_eq!(sent.tools, client.tools);
        let result = sent.messages[0].content_text();
        assert!(result.len() < client.messages[0].content_text().len());
        assert!(
            (0..20).all(|i| result.contains(&format!("\"R{i}\""))),
            "{result}"
        );
        assert!(rewrite.report.fits && rewrite.report.tokens_after < rewrite.report.tokens_before);
        assert_eq!(rewrite.report.stages.len(), 1);
    }

    #[test]
    fn the_chains_block_goes_in_place_of_the_tools_when_the_stage_is_on() {
        let mut config = PipelineConfig::default();
        let counter = TokenCounter::new(Encoding::O200kBase);
        let memo = Memo::default();
        let client = request();
        let tools = client.tools.get().unwrap().clone();
        let stub = crate::pipeline::tools::stubs::stub(&tools[0], 4, &counter, &memo);
        let block = vec![stub];
        let chain = ChainTools::of(&client, &block, Vec::new()).expect("a block of its own");
        for enabled in [true, false] {
            config.tools.enabled = enabled;
            let rewrite = run(&client, &env(&config, &counter, &memo), Some(&chain));
            let tools_stage = rewrite.report.stage(StageName::Tools);
            if enabled {
                assert_eq!(rewrite.request.tools.get(), Some(&block));
                let stage = tools_stage.expect("the tools stage reports the block");
                assert_eq!(stage.tokens_after, rewrite.report.tokens_after);
                assert_eq!(
                    counter.request(&rewrite.request),
                    rewrite.report.tokens_after
                );
            } else {
                assert_eq!(rewrite.request.tools, client.tools);
                assert!(tools_stage.is_none());
            }
        }
    }

    #[test]
    fn text_that_is_not_json_and_content_parts_are_left_as_they_are() {
        let mut client = request();
        client.messages[0].content = Nullable::Value(Content::Parts(vec![ContentPart {
            kind: "text".into(),
            text: Nullable::Value("{\n \"id\": 1\n}".into()),
            extra: Default::default(),
        }]));
        client.messages.insert(
            1,
            Message::text(Role::Tool, "line one\n\n  line two   with spaces"),
        );
        for message in &client.messages {
            assert!(compact::minified_result(message).is_none(), "{message:?}");
        }
    }
}
