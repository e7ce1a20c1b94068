"""Built-in prompts for the ``math`` and ``translation`` workloads.

``math`` asks for step-by-step arithmetic reasoning (formulaic text a draft often predicts);
``translation`` asks for a rewrite in another language (little to copy from the prompt, but
names and numbers recur). Both use several languages and problem types.
"""

from __future__ import annotations

MATH: tuple[str, ...] = (
    "A train travels 180 km in 2.5 hours. What is its average speed in km/h? Show your steps.",

    "A shop raises the price of a 40 dollar jacket by 25 percent, then offers a 20 percent "
    "discount on the new price. What is the final price, and is it higher or lower than the "
    "original? Solve step by step.",

    "Maria invests 2,500 dollars at an annual interest rate of 4 percent, compounded yearly. How "
    "much will she have after 3 years? Round to the nearest cent and show each year's balance.",

    "Three apples and two oranges cost 3.40 dollars. Two apples and five oranges cost 4.30 "
    "dollars. What does one apple cost and what does one orange cost? Set up and solve the "
    "system of equations.",

    "Two fair six-sided dice are rolled. What is the probability that the sum is 8? List the "
    "favourable outcomes and simplify the fraction.",

    "A circular garden has a radius of 6 meters. A path 1.5 meters wide runs around the outside of "
    "it. What is the area of the path? Give the exact answer in terms of pi and a decimal "
    "approximation.",

    "Pipe A fills a tank in 6 hours and pipe B fills it in 9 hours. A drain empties the full tank "
    "in 18 hours. If all three are open, how long does it take to fill the empty tank? Explain "
    "your reasoning.",

    "A chemist has 10 liters of a 30 percent acid solution. How many liters of a 70 percent "
    "solution must be added to obtain a 45 percent solution? Show the equation and solve it.",

    "The sum of three consecutive even integers is 138. Find the integers and check your answer.",
)

TRANSLATION: tuple[str, ...] = (
    "Translate into French: The museum is closed on Mondays. Tickets can be bought online or at "
    "the entrance, and children under twelve enter for free.",

    "Translate into German: Please remember to water the plants twice a week while we are away. "
    "The key to the garden shed is under the blue flower pot.",

    "Translate into Spanish: Our team will release the new version of the app next Thursday. It "
    "fixes the login problem and makes the search much faster.",

    "Translate into English: Le train de 8 h 15 a été annulé en raison d'une panne de signalisation. "
    "Les voyageurs sont invités à prendre le bus de remplacement devant la gare.",

    "Translate into English: Wir haben das Angebot geprüft und möchten drei Laptops bestellen. "
    "Könnten Sie uns bitte mitteilen, wann die Lieferung erfolgen kann?",

    "Translate into Italian: The conference starts at nine in the morning. Lunch will be served "
    "in the main hall, and the last session ends at half past five.",

    "Translate into Portuguese: If you have any questions about your order, reply to this email "
    "and a member of our support team will answer within one business day.",

    "Translate into English: La receta es sencilla: mezcla la harina con el agua, deja reposar la "
    "masa durante una hora y después hornéala a fuego medio hasta que esté dorada.",
)
