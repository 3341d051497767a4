//! Deterministic synthetic agent conversations of any length, for benchmarks and the growth
//! report (`ctxproxy analyze --growth`): the same generator feeds criterion and the O(1) check.
//!
//! A conversation is a travel-support agent session: each turn asks about a different
//! reservation or topic, two turns in three call a tool whose JSON result looks like a real
//! API answer, every fifth turn searches and gets a list, and some turns state facts.
//! `autonomous_agent` is the other shape: one task, then dozens of tool calls with large
//! results, where a late call reuses an id from an early result.

use serde_json::{Value, json};

use crate::openai::ChatRequest;

const TOPICS: [(&str, &str); 8] = [
    (
        "baggage",
        "how many checked bags are included and what the fee is for an extra suitcase",
    ),
    (
        "seat",
        "whether I can pick a window seat in the exit row for the return flight",
    ),
    (
        "refund",
        "if the cancelled segment qualifies for a refund to the original card",
    ),
    (
        "upgrade",
        "the price of upgrading the outbound leg to business class with miles",
    ),
    (
        "insurance",
        "what the travel insurance covers when a connection is missed",
    ),
    (
        "meal",
        "adding a vegetarian meal and checking the allergy note on the booking",
    ),
    (
        "pet",
        "bringing a small dog in the cabin and the carrier size limits",
    ),
    (
        "loyalty",
        "why the miles from last month's trip are not on my loyalty account yet",
    ),
];

const FACTS: [&str; 4] = [
    "Remember that I prefer aisle seats on every flight.",
    "My name is Mia Li and my member number is GLD-4471.",
    "From now on, send confirmations to mia.li@example.com only.",
    "I decided to keep the Seattle trip even if the fee is high.",
];

fn reservation(turn: usize) -> Value {
    let cabin = ["economy", "basic_economy", "business"][turn % 3];
    json!({
        "reservation_id": format!("R{:05}", 31000 + turn * 7),
        "user_id": "mia_li_3668",
        "origin": "JFK",
        "destination": if turn.is_multiple_of(2) { "SEA" } else { "ORD" },
        "flight_type": "round_trip",
        "cabin": cabin,
        "flights": [
            {"flight_number": format!("HAT{:03}", 100 + turn), "date": format!("2024-05-{:02}", 1 + turn % 28), "origin": "JFK", "destination": "SEA", "price": 400 + turn * 3, "status": "available"},
            {"flight_number": format!("HAT{:03}", 300 + turn), "date": format!("2024-06-{:02}", 1 + turn % 28), "origin": "SEA", "destination": "JFK", "price": 380 + turn * 2, "status": "available"}
        ],
        "passengers": [
            {"first_name": "Mia", "last_name": "Li", "dob": "1990-04-05"},
            {"first_name": "Noah", "last_name": "Li", "dob": "2015-09-12"}
        ],
        "payment_history": [
            {"payment_id": format!("credit_card_{}", 4_421_486 + turn), "amount": 780 + turn * 5},
            {"payment_id": "gift_card_8817", "amount": 120}
        ],
        "created_at": format!("2024-04-{:02}T10:{:02}:00", 1 + turn % 28, turn % 60),
        "total_baggages": turn % 3,
        "nonfree_baggages": turn % 2,
        "insurance": if turn.is_multiple_of(4) { "yes" } else { "no" },
        "membership": "gold",
        "notes": null,
        "policy": "Changes are allowed for a fee; basic economy cannot be modified after 24 hours. Refunds go to the original payment method within 7 business days. Travel insurance covers missed connections caused by the airline.",
    })
}

fn search_results(turn: usize) -> Value {
    let flights: Vec<Value> = (0..8)
        .map(|i| {
            json!({
                "flight_number": format!("HAT{:03}", 500 + turn + i),
                "origin": "JFK",
                "destination": "SEA",
                "scheduled_departure_time_est": format!("{:02}:00:00", 6 + i),
                "scheduled_arrival_time_est": format!("{:02}:30:00", 12 + i),
                "status": "available",
                "available_seats": {"basic_economy": 9 - i, "economy": 12 + i, "business": i % 4},
                "prices": {"basic_economy": 89 + i * 4, "economy": 149 + i * 6, "business": 612 + i * 11},
                "aircraft": {"model": "A321neo", "registration": format!("N{}HA", 400 + i)},
                "notes": null
            })
        })
        .collect();
    json!({"query": {"origin": "JFK", "destination": "SEA", "date": format!("2024-05-{:02}", 1 + turn % 28)}, "count": flights.len(), "flights": flights})
}

/// A chat request whose history holds `turns` complete turns plus the current question.
pub fn conversation(turns: usize) -> Result<ChatRequest, serde_json::Error> {
    let mut messages = vec![json!({
        "role": "system",
        "content": "You are the support agent of Horizon Air. Be concise and accurate. \
                    Follow the airline policy: verify the user's identity before changes, \
                    never invent reservation data, confirm every change with the user first, \
                    and explain fees before charging them. "
            .repeat(3),
    })];
    for turn in 0..=turns {
        let (topic, question) = TOPICS[turn % TOPICS.len()];
        let reservation_id = format!("R{:05}", 31000 + turn * 7);
        let mut user = format!("About reservation {reservation_id}: I'd like to know {question}.");
        if turn % 9 == 3 {
            user = format!("{} {user}", FACTS[(turn / 9) % FACTS.len()]);
        }
        messages.push(json!({"role": "user", "content": user}));
        if turn == turns {
            break;
        }
        if turn % 3 != 2 {
            let (name, arguments, result) = if turn % 5 == 4 {
                (
                    "search_direct_flight",
                    json!({"origin": "JFK", "destination": "SEA"}),
                    search_results(turn),
                )
            } else {
                (
                    "get_reservation_details",
                    json!({"reservation_id": reservation_id}),
                    reservation(turn),
                )
            };
            let id = format!("call_{turn:04}");
            messages.push(json!({"role": "assistant", "content": null, "tool_calls": [{"id": id, "type": "function", "function": {"name": name, "arguments": arguments.to_string()}}]}));
            messages
                .push(json!({"role": "tool", "tool_call_id": id, "content": result.to_string()}));
        }
        messages.push(json!({
            "role": "assistant",
            "content": format!(
                "For reservation {reservation_id} ({topic}): the {topic} rules depend on the cabin \
                 and your gold membership. I checked the booking and everything is in order; \
                 flight HAT{:03} is confirmed. Would you like me to make a change?",
                100 + turn
            ),
        }));
    }
    let tools: Vec<Value> = [
        ("get_reservation_details", "Get the details of a reservation by its id."),
        ("search_direct_flight", "Search direct flights between two airports on a date."),
        ("update_reservation_flights", "Change the flights of a reservation."),
        ("cancel_reservation", "Cancel a whole reservation."),
        ("get_user_details", "Get a user's profile, payment methods and reservations."),
        ("send_certificate", "Send a compensation certificate to a user."),
    ]
    .iter()
    .map(|(name, description)| {
        json!({"type": "function", "function": {"name": name, "description": description,
            "parameters": {"type": "object", "properties": {"id": {"type": "string", "description": "The identifier of the object."}}, "required": ["id"]}}})
    })
    .collect();
    let body = json!({"model": "gpt-4o", "messages": messages, "tools": tools, "temperature": 0});
    serde_json::from_value(body)
}

/// A ticket record of the autonomous agent's tools.
fn ticket(step: usize, i: usize) -> Value {
    let n = step * 100 + i;
    let status = ["open", "pending", "escalated"][n % 3];
    json!({
        "ticket_id": format!("TKT-{n:05}"),
        "customer_email": format!("customer{n}@example.com"),
        "amount": format!("{}.{:02}", 20 + n % 480, n % 100),
        "created_at": format!("2024-03-{:02}T{:02}:15:00Z", 1 + n % 28, n % 24),
        "status": status,
        "summary": "The customer reports that the invoice total does not match the order \
                    and asks for a correction before the next billing cycle closes.",
    })
}

/// The result of step `step`: 1 to about 20 KB, by a fixed pattern.
fn agent_result(step: usize) -> Value {
    let count = 4 + (step * 7) % 66;
    let tickets: Vec<Value> = (0..count).map(|i| ticket(step, i)).collect();
    json!({"step": step, "count": count, "tickets": tickets})
}

/// An autonomous agent's conversation: one task from the user, then `steps` tool calls, each
/// with a result of 1–20 KB; the last call reuses a ticket id from the third result (the kind
/// of working memory a rewrite must not lose). Ends with that call's result, so the next answer
/// is the model's.
pub fn autonomous_agent(steps: usize) -> Result<ChatRequest, serde_json::Error> {
    let mut messages = vec![
        json!({"role": "system", "content": "You are a billing operations agent. Work through the \
            task with the tools; never invent ticket ids or amounts."}),
        json!({"role": "user", "content": "Audit every open billing ticket from March and \
            correct the ones whose amount is wrong, then report what you changed."}),
    ];
    for step in 0..steps {
        let id = format!("call_{step:03}");
        let (name, arguments, result) = if step + 1 == steps {
            // Reuses an id seen only in an early result.
            let early = format!("TKT-{:05}", 2 * 100 + 1);
            (
                "update_ticket",
                json!({"ticket_id": early, "amount": "221.01"}),
                json!({"ticket_id": early, "updated": true, "amount": "221.01"}),
            )
        } else {
            (
                "search_tickets",
                json!({"page": step + 1, "month": "2024-03"}),
                agent_result(step),
            )
        };
        messages.push(
            json!({"role": "assistant", "content": null, "tool_calls": [{"id": id,
            "type": "function", "function": {"name": name, "arguments": arguments.to_string()}}]}),
        );
        messages.push(json!({"role": "tool", "tool_call_id": id, "content": result.to_string()}));
    }
    let tools: Vec<Value> = [
        (
            "search_tickets",
            "Search billing tickets, one page at a time.",
        ),
        ("update_ticket", "Change the amount of a ticket."),
    ]
    .iter()
    .map(|(name, description)| {
        json!({"type": "function", "function": {"name": name, "description": description,
            "parameters": {"type": "object", "properties": {}}}})
    })
    .collect();
    serde_json::from_value(json!({"model": "gpt-4o", "messages": messages, "tools": tools}))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_autonomous_agent_has_one_task_and_large_results() {
        let request = autonomous_agent(60).unwrap();
        assert_eq!(request.messages.len(), 2 + 2 * 60);
        let sizes: Vec<usize> = request
            .messages
            .iter()
            .filter(|m| m.role == crate::openai::Role::Tool)
            .take(59)
            .map(|m| m.content.get().map_or(0, |c| c.text().len()))
            .collect();
        assert!(
            sizes.iter().all(|&s| (1_000..=21_000).contains(&s)),
            "{sizes:?}"
        );
        let last_call = &request.messages[request.messages.len() - 2].tool_calls()[0];
        assert!(last_call.function.arguments.contains("TKT-00201"));
        let third = request.messages[7]
            .content
            .get()
            .unwrap()
            .text()
            .into_owned();
        assert!(third.contains("TKT-00201"));
    }
}
