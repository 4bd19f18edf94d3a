// text/token_ids.h: the token-id lists users type (run / draft --tokens, detokenize).
#include "text/token_ids.h"

#include <gtest/gtest.h>

#include <string>

#include "util/error.h"

namespace dflash {
namespace {

using Ids = std::vector<int32_t>;

TEST(TokenIds, CommasSpacesAndJsonArrays) {
  EXPECT_EQ(parse_token_ids("1,2,3", "--tokens"), (Ids{1, 2, 3}));
  EXPECT_EQ(parse_token_ids("1 2  3", "--tokens"), (Ids{1, 2, 3}));
  EXPECT_EQ(parse_token_ids("[151644, 872, 198]", "--tokens"), (Ids{151644, 872, 198}));
  EXPECT_EQ(parse_token_ids(" 7 ,\t8,\n9 ,", "--tokens"), (Ids{7, 8, 9}));
  EXPECT_EQ(parse_token_ids("0", "--tokens"), (Ids{0}));
  EXPECT_EQ(parse_token_ids("2147483647", "--tokens"), (Ids{2147483647}));
  EXPECT_TRUE(parse_token_ids("", "--tokens").empty());
  EXPECT_TRUE(parse_token_ids(" , [] ", "--tokens").empty());
}

// The message names the option and the item.
std::string error_of(const std::string& text) {
  try {
    parse_token_ids(text, "--tokens");
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(TokenIds, BadItemsAreErrorsThatNameThem) {
  // trailing letters were once read as the number before them (run --tokens 12abc -> 12)
  EXPECT_NE(error_of("1,12abc,3").find("--tokens: '12abc' is not a token id"), std::string::npos) << error_of("1,12abc,3");
  EXPECT_NE(error_of("-1").find("'-1' is not a token id"), std::string::npos) << error_of("-1");
  EXPECT_NE(error_of("+5").find("'+5' is not a token id"), std::string::npos);
  EXPECT_NE(error_of("1.5").find("'1.5' is not a token id"), std::string::npos);
  EXPECT_NE(error_of("hello").find("'hello' is not a token id"), std::string::npos);
  EXPECT_NE(error_of("2147483648").find("token id '2147483648' is too large"), std::string::npos)
      << error_of("2147483648");
  EXPECT_NE(error_of("99999999999999999999999").find("is too large"), std::string::npos);
  EXPECT_NE(error_of("{\"a\": 1}").find("is not a token id"), std::string::npos);
}

}  // namespace
}  // namespace dflash
