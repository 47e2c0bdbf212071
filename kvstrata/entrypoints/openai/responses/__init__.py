"""OpenAI's Responses API (/v1/responses) over the chat path, with the conversation kept server-side.

A turn's prompt is the stored conversation of `previous_response_id` (its input and reply, as chat
messages), then the new input, rendered by the model's chat template after `instructions` (which,
as OpenAI's, are not carried over). A text reply is stored as the text the model wrote, so turn
k+1's prompt begins with turn k's prompt and reply token for token and the prefix cache serves it:

    turn k     [instructions | input 1 | reply 1 | ... | input k] [reply k]
    turn k+1   [instructions | input 1 | reply 1 | ... | input k | reply k] [input k+1]
               '------------------ cached, block by block -----------------'

What breaks the chain: other instructions or tools (they render first), and a reply re-rendered
differently from how it was written (tool calls go back as `<tool_call>` tags).
"""
