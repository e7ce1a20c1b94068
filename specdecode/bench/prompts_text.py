"""Built-in prompts for the ``chat``, ``summarization`` and ``rag`` workloads.

``chat`` is open-ended assistant talk (the hardest case for drafting: little to copy, varied
wording). ``summarization`` and ``rag`` hand the model a passage, so answers reuse its spans. The
passages are written for this package (fictional facts), so no model has memorised them.
"""

from __future__ import annotations

CHAT: tuple[str, ...] = (
    "What are three practical tips for getting better sleep?",

    "I have three days and a small budget in Lisbon. Suggest a day-by-day plan with cheap food "
    "and free or low-cost sights.",

    "Explain the difference between a virus and a bacterium to a ten-year-old.",

    "Write a short, polite email declining an invitation to a Friday meeting because I am on "
    "leave, and offer two alternative times next week.",

    "How does compound interest work? Give an example with 1,000 dollars at 5 percent a year for "
    "three years.",

    "Here is the opening of my cover letter: 'I am writing to apply for the job. I think I would "
    "be good at it because I work hard.' How can I make it stronger? Give a rewritten version.",

    "Suggest five names for a small coffee shop that is also a second-hand bookstore, with one "
    "sentence on why each name works.",

    "What should I weigh when deciding between renting and buying a home? Keep it to the main "
    "factors.",
)

_SUMMARY_PASSAGES: tuple[tuple[str, str], ...] = (
    ("Summarize the following quarterly update in three bullet points.",
     "Northwind Outdoor Supply reported revenue of 48.2 million dollars for the third quarter, up "
     "12 percent from the same quarter last year. Growth came mainly from the camping category, "
     "where sales of lightweight tents rose 31 percent after the company opened two new "
     "distribution centers in Denver and Atlanta. Online orders now make up 44 percent of "
     "revenue, compared with 36 percent a year ago. Gross margin fell slightly, from 41.5 to 40.1 "
     "percent, because of higher shipping costs and discounts offered during a slow August. The "
     "company cut its inventory by 9 percent and paid down 5 million dollars of debt. Management "
     "kept its full-year forecast of 180 to 185 million dollars in revenue and said it will "
     "launch a repair and resale program for used gear in the spring."),
    ("Summarize this research note in one paragraph for a general audience.",
     "Researchers at the Halden Field Station tracked 240 bumblebee colonies across three summers "
     "to test whether wildflower strips along farm fields help the bees. Colonies placed within "
     "200 meters of a strip produced on average 38 percent more new queens than colonies placed "
     "near fields without strips. The effect was strongest in July, when crops had finished "
     "flowering and the strips were the main food source. Colonies near strips also carried fewer "
     "gut parasites, which the authors think reflects a more varied diet. The strips cost farmers "
     "about 300 euros per hectare per year to maintain. The team cautions that the study covered "
     "only one region with mild summers and that hotter, drier areas may see smaller benefits. "
     "They plan to repeat the work on farms in the south of the country next year."),
    ("Give a TL;DR of these meeting minutes in two sentences.",
     "The Riverton city council met on Tuesday evening with all seven members present. The main "
     "item was the proposal to convert Mill Street into a pedestrian zone on weekends from May to "
     "September. Shop owners on the street spoke for and against: cafes supported the plan, while "
     "two hardware stores worried about deliveries and customers who need to carry heavy goods. "
     "The transport office presented a traffic study showing that nearby Oak Avenue could absorb "
     "the diverted cars with new signal timings. After an hour of discussion, the council voted 5 "
     "to 2 to run a one-summer trial, with delivery windows before 10 a.m. and a review in "
     "October. The council also approved 120,000 dollars to repair the playground at Elm Park "
     "and postponed a vote on parking fees to the next meeting."),
    ("Summarize these release notes for users who are deciding whether to upgrade.",
     "Version 4.2 of the Tallyhand invoicing app adds recurring invoices: a customer can now be "
     "billed automatically every week, month or quarter, and each invoice can still be edited "
     "before it is sent. PDF exports are about twice as fast and now include the company logo in "
     "high resolution. The tax engine supports reduced VAT rates for Portugal and Ireland. We "
     "removed the legacy CSV importer; use the new importer under Settings, which validates files "
     "before importing. A bug that sent duplicate payment reminders to customers in a different "
     "time zone has been fixed. Upgrading requires iOS 16 or Android 12 or later, and the first "
     "launch after the update migrates local data, which can take up to a minute for large "
     "accounts."),
    ("Summarize the following passage in about 60 words.",
     "Before the printing press reached Europe in the fifteenth century, most books were copied by "
     "hand, often in monasteries, and a single Bible could take a scribe more than a year. "
     "Printing with movable metal type changed the economics of text. A workshop could produce "
     "hundreds of identical copies in the time a scribe made one, and prices fell sharply. Within "
     "fifty years, printers were working in more than 250 European towns. Cheaper books spread "
     "literacy beyond the clergy and the rich, helped standardize spelling within languages, and "
     "let scholars compare the same edition of a text across cities. Critics at the time worried "
     "that printed books would be full of errors and that too much reading would weaken memory."),
    ("Summarize this support conversation: what was the problem, what was tried, and how was it "
     "resolved?",
     "Customer: My smart plug stopped responding in the app yesterday. The light on it is "
     "blinking orange. Agent: Thanks for reaching out. Blinking orange means the plug lost its "
     "Wi-Fi connection. Did anything change with your router? Customer: We replaced the router "
     "last weekend, same network name but a new password. Agent: That explains it. The plug "
     "still has the old password saved. Please hold the button for five seconds until the light "
     "blinks blue quickly, then open the app and choose Add Device. Customer: Done, it is blinking "
     "blue, but the app says it cannot find the plug. Agent: Your new router may be broadcasting "
     "only on 5 GHz. The plug needs a 2.4 GHz network. Can you enable 2.4 GHz in the router "
     "settings? Customer: I turned it on and the app found the plug right away. It works now. "
     "Agent: Great, glad it is fixed."),
    ("Write a short news brief (three sentences) summarizing this report.",
     "The Carver Street bridge will close to all vehicle traffic for eight weeks starting on June "
     "3 so that crews can replace its expansion joints and resurface the deck, the county roads "
     "department said on Monday. Inspectors found cracking in two of the four joints during a "
     "routine check in March, and the department said the repairs cannot wait until next year. "
     "Pedestrians and cyclists will be able to use a protected lane on the east side for most of "
     "the closure, except for four nights when the lane must close for crane work. Drivers are "
     "advised to use the Highway 9 bridge, which adds about six minutes to a typical trip. Bus "
     "route 14 will be detoured and two stops will move temporarily. The project costs 2.3 "
     "million dollars and is paid for from the state bridge maintenance fund."),
    ("Summarize the key points of this policy memo as a numbered list.",
     "From next month, all employees who work remotely at least two days a week must use the "
     "company VPN when accessing internal systems, including email on personal devices. Laptops "
     "issued by the company will receive automatic disk encryption during the October update; "
     "employees do not need to do anything except restart when prompted. Personal laptops may "
     "still be used for video calls but not for handling customer data. Lost or stolen devices "
     "must be reported to the help desk within 24 hours so that access can be revoked. Managers "
     "will complete a short security training by the end of the quarter and pass it on to their "
     "teams. Questions should go to the security team's shared mailbox rather than to individual "
     "engineers."),
)

SUMMARIZATION: tuple[str, ...] = tuple(f"{ask}\n\n{text}" for ask, text in _SUMMARY_PASSAGES)

_RAG_INSTRUCTION = ("Answer the question using only the passage below. Quote the relevant "
                    "sentence, then give the answer. If the passage does not contain the answer, "
                    "say so.")

_RAG_ITEMS: tuple[tuple[str, str], ...] = (
    ("How many vacation days does an employee with six years of service get, and how many can be "
     "carried over?",
     "Vacation policy. Full-time employees receive 20 days of paid vacation per calendar year. "
     "After five complete years of service, the allowance rises to 25 days. Up to five unused days "
     "may be carried over into the first quarter of the following year; any days still unused on "
     "March 31 are forfeited. Part-time employees receive vacation in proportion to their "
     "contracted hours. Requests longer than ten consecutive working days need approval from a "
     "department head at least one month in advance."),
    ("What does it mean when the thermostat display shows E4, and what should I do?",
     "Troubleshooting the Calora T3 thermostat. E1 means the temperature sensor is not responding; "
     "restart the unit by removing it from the wall plate for ten seconds. E2 means the batteries "
     "are low; replace both AA batteries within one week. E4 means the thermostat cannot "
     "communicate with the heating system; check that the wire labelled W is firmly seated in its "
     "terminal, and if the code persists, switch off the heating system at the breaker for one "
     "minute. E7 indicates a firmware problem and requires contacting support."),
    ("If my client sends 150 requests in one minute on the Standard plan, what happens and when "
     "can it retry?",
     "Rate limits. Free accounts may send 60 requests per minute; Standard accounts 120; "
     "Enterprise accounts 600. Limits apply per API key over a sliding one-minute window. A "
     "request over the limit receives HTTP status 429 with a Retry-After header giving the number "
     "of seconds to wait before the next request will be accepted. Requests rejected this way do "
     "not count toward the limit. Repeated violations over an hour may lead to a temporary key "
     "suspension, which is announced by email."),
    ("How deep is Lake Vessen at its deepest point, and why is swimming restricted in the north?",
     "Lake Vessen is a glacial lake about 14 kilometers long, fed by three mountain streams. Its "
     "average depth is 38 meters and its deepest point, near the eastern cliffs, reaches 112 "
     "meters. The water stays below 18 degrees Celsius even in August. Swimming is allowed at the "
     "two beaches on the southern shore. The northern bay is closed to swimmers because it is a "
     "breeding ground for a protected species of grebe, and boats must keep 200 meters from the "
     "reed beds there between April and July."),
    ("Can I use frozen berries in this recipe, and how long should the cake bake?",
     "Blueberry yogurt cake. Whisk 3 eggs with 200 grams of sugar until pale, then stir in 250 "
     "grams of plain yogurt and 120 milliliters of oil. Fold in 300 grams of flour mixed with 2 "
     "teaspoons of baking powder. Toss 250 grams of blueberries in a tablespoon of flour so they do "
     "not sink; frozen berries work too, but add them straight from the freezer without thawing. "
     "Bake at 175 degrees Celsius for 50 to 55 minutes, until a skewer comes out clean, and let "
     "the cake cool for 15 minutes before removing it from the tin."),
    ("Is my bicycle allowed on the bus at 8 a.m. on a weekday?",
     "Bicycles on buses. Folding bicycles are allowed on all buses at all times if they are folded "
     "and do not block the aisle. Full-size bicycles may be carried on the front rack of buses "
     "that have one, which includes all routes numbered 1 to 40. Racks hold two bicycles and are "
     "available on a first-come basis. Full-size bicycles are not allowed inside the bus, except "
     "on Sundays and public holidays, when up to two may be carried in the wheelchair area if it "
     "is not needed."),
    ("How many books can a student borrow, and what is the fine for a late laptop?",
     "Lending rules at the Ashgrove Public Library. Adult members may borrow up to 12 items at "
     "once; students with a valid school ID may borrow up to 8. Books are lent for three weeks and "
     "can be renewed twice online unless another member has reserved them. Laptops are lent for "
     "four hours and must be used inside the building. Late books cost 20 cents per day, capped at "
     "5 dollars per item. A late laptop costs 2 dollars per hour, and laptop borrowing is "
     "suspended for one month after a second late return."),
    ("Does the warranty cover a cracked screen, and how long does it last?",
     "Limited warranty. The manufacturer warrants the Orbis tablet against defects in materials "
     "and workmanship for 24 months from the date of purchase. The battery is covered for 12 "
     "months or until its capacity falls below 80 percent, whichever comes first. The warranty "
     "does not cover damage caused by drops, liquids, or unauthorized repairs, including cracked "
     "screens. Owners who bought the optional CarePlus plan may have accidental damage repaired "
     "twice during the plan term for a fixed fee of 49 dollars each time."),
)

RAG: tuple[str, ...] = tuple(
    f"{_RAG_INSTRUCTION}\n\nPassage: {passage}\n\nQuestion: {question}" for question, passage in _RAG_ITEMS
)
